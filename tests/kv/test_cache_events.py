"""Replaying the pool's cache events gives exactly its hash index, at every step."""

from __future__ import annotations

import random

import pytest

from pagewarden.kv.block import BlockHash
from pagewarden.kv.block_pool import BlockPool
from pagewarden.kv.cache_events import BlockRemoved, BlockStored, CacheEvent
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched import Request, Scheduler, SchedulerConfig
from pagewarden.sched.fake_runner import FakeModelRunner


def replay(index: dict[BlockHash, BlockHash | None], events: list[CacheEvent]) -> None:
    """Apply events to ``index`` (hash -> parent hash), checking each is consistent."""
    for e in events:
        if isinstance(e, BlockStored):
            assert e.block_hash not in index, "stored twice without a removal"
            assert e.parent_hash is None or len(e.parent_hash) == 32
            index[e.block_hash] = e.parent_hash
        else:
            assert isinstance(e, BlockRemoved)
            del index[e.block_hash]  # KeyError: removed a hash that was never stored


def test_pool_records_nothing_until_asked() -> None:
    pool = BlockPool(4, 2)
    (block,) = pool.get_new_blocks(1)
    pool.seal(block, BlockHash(b"h" * 32), [1, 2])
    assert pool.cache_events is None
    assert pool.take_cache_events() == []
    pool.quarantine(block.block_id)
    assert pool.take_cache_events() == [BlockRemoved(BlockHash(b"h" * 32))]
    assert pool.take_cache_events() == []


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_replayed_events_equal_the_hash_index_after_every_step(mode: str) -> None:
    rng = random.Random(7)
    cfg = SchedulerConfig(
        num_blocks=24,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=64,
        preemption_mode=mode,
        num_host_blocks=12 if mode == "swap" else 0,
    )
    s = Scheduler(cfg)
    pool = s.kv.pool
    runner = FakeModelRunner(cfg.block_size)
    assert pool.take_cache_events() == []  # start recording
    shared = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    index: dict[BlockHash, BlockHash | None] = {}
    stored = removed = 0
    for i in range(300):
        prompt = rng.choice(shared)[: rng.randint(4, 12)] + [rng.randrange(50) for _ in range(3)]
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True, seed=i)
        s.add_request(Request(f"r{i}", prompt, params, cache_salt=rng.choice([None, "t"])))
        if i % 3:
            continue
        out = s.schedule()
        s.update(out, runner.execute(out))
        if i % 30 == 0 and pool.hash_index:  # a fault: its block leaves the index
            pool.quarantine(rng.choice(list(pool.hash_index.values())).block_id)
        events = pool.take_cache_events()
        stored += sum(isinstance(e, BlockStored) for e in events)
        removed += sum(isinstance(e, BlockRemoved) for e in events)
        replay(index, events)
        assert set(index) == set(pool.hash_index)
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update(out, runner.execute(out))
        replay(index, pool.take_cache_events())
    assert set(index) == set(pool.hash_index)
    assert stored > 50 and removed > 20  # eviction and quarantine both happened
    # Every stored block's parent was in the index when it was stored, or it is a root.
    assert any(parent is not None for parent in index.values())
