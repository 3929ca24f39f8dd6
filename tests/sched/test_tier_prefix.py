"""Asynchronous tier loads in the scheduler: a request waits for its load without holding a
block while the others step; then it is admitted with its loaded blocks; an abort while
loading leaves nothing behind. A fake tier stands in (no bytes, no torch)."""

from __future__ import annotations

import struct
import threading
import time

from pagewarden.kvstore.format import BlockIdentity
from pagewarden.kvstore.loader import LoadedBlock, TierLoader
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched import Request, Scheduler, SchedulerConfig
from pagewarden.sched.fake_runner import FakeModelRunner
from pagewarden.sched.tier_prefix import TierPrefix


class FakeTier:
    """Holds the first ``stored`` blocks of a prompt ``range(base, ...)`` in blocks of 4
    (a block's index is read from its first token: fetches may run in any order);
    ``get`` waits on ``gate``. A block's checksum is its index + 1."""

    def __init__(self, stored: int, base: int = 100) -> None:
        self.stored = stored
        self.base = base
        self.gate = threading.Event()
        self.asked: list[BlockIdentity] = []

    def load_one(self, ident: BlockIdentity) -> LoadedBlock | None:
        self.gate.wait()
        self.asked.append(ident)
        index = (struct.unpack_from("<I", ident.token_bytes)[0] - self.base) // 4
        if index >= self.stored:
            return None
        return LoadedBlock(b"kv", index + 1, "disk", f"k{index + 1}")


def _setup(stored: int) -> tuple[Scheduler, FakeTier, TierLoader]:
    s = Scheduler(
        SchedulerConfig(
            num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64
        )
    )
    tier = FakeTier(stored)
    loader = TierLoader(tier.load_one, stall_timeout_s=600.0)
    s.kv.pool.evicted = []
    s.tier_prefix = TierPrefix(loader.start, loader.wait)
    return s, tier, loader


def _req(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_a_loading_request_waits_while_the_other_decodes_then_joins_with_its_blocks():
    s, tier, _ = _setup(stored=2)
    runner = FakeModelRunner(4)
    tier.gate.set()
    s.add_request(_req("b", [1, 2, 3], 20))
    while not s.running:  # b's own load (a miss) first
        s.update(out := s.schedule(), runner.execute(out))
    tier.gate.clear()
    s.add_request(_req("a", list(range(100, 113)), 3))  # 13 tokens: 3 full blocks to reuse
    decoded = 0
    for _ in range(5):
        out = s.schedule()
        assert [r.req_id for r in out.requests] == ["b"] and not out.tier_loads
        decoded += len(s.update(out, runner.execute(out)))
    assert decoded == 5 and s.tier_prefix.is_loading("a")
    assert s.requests["a"] in s.waiting and "a" not in s.kv.tables
    tier.gate.set()
    s.tier_prefix.pending["a"].job.done.wait(10)
    out = s.schedule()
    a = next(r for r in out.requests if r.req_id == "a")
    # Two blocks came from the tier (the third missed): a computes from token 8.
    assert a.positions.start == 8 and len(out.tier_loads) == 2
    ids = s.kv.tables["a"].ids
    assert [t.block_id for t in out.tier_loads] == ids[:2]
    assert [t.index for t in out.tier_loads] == [0, 1]
    assert [t.checksum for t in out.tier_loads] == [1, 2]
    assert not s.tier_prefix.pending
    assert s.check_invariants() == []


def test_aborting_a_request_while_it_loads_leaves_nothing_behind():
    s, tier, _ = _setup(stored=3)
    free = s.kv.pool.num_free_blocks
    s.add_request(_req("a", list(range(100, 113)), 3))
    out = s.schedule()  # the load starts (blocked in the tier); nothing to run
    assert not out.requests and s.tier_prefix.is_loading("a")
    job = s.tier_prefix.pending["a"].job
    s.abort_requests(["a"])
    assert job.cancelled and not s.tier_prefix.pending
    assert s.kv.pool.num_free_blocks == free and not s.kv.tables
    tier.gate.set()
    assert job.done.wait(10)
    assert job.blocks == []  # nothing taken after the cancel
    assert not s.has_unfinished_requests() and s.check_invariants() == []


def test_a_stalled_load_gives_up_and_the_request_computes():
    s = Scheduler(
        SchedulerConfig(
            num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64
        )
    )
    tier = FakeTier(stored=3)
    loader = TierLoader(tier.load_one, stall_timeout_s=0.05)
    s.kv.pool.evicted = []
    s.tier_prefix = TierPrefix(loader.start, loader.wait)
    s.add_request(_req("a", list(range(100, 113)), 3))
    out = s.schedule()
    for _ in range(200):  # each empty schedule waits up to 20 ms for the load
        if out.requests:
            break
        out = s.schedule()
    assert [r.req_id for r in out.requests] == ["a"]
    assert out.requests[0].positions.start == 0 and not out.tier_loads
    assert loader.timeouts == 1
    tier.gate.set()


class BarrierTier(FakeTier):
    """Every fetch waits until ``parties`` fetches wait together: a loader that fetches one
    block at a time breaks the barrier (and the load fails)."""

    def __init__(self, stored: int, parties: int, base: int = 100) -> None:
        super().__init__(stored, base)
        self.gate.set()
        self.barrier = threading.Barrier(parties, timeout=10)

    def load_one(self, ident: BlockIdentity) -> LoadedBlock | None:
        self.barrier.wait()
        return super().load_one(ident)


def test_a_chain_s_blocks_are_fetched_in_parallel_and_taken_in_order():
    tier = BarrierTier(stored=8, parties=4)
    loader = TierLoader(tier.load_one, stall_timeout_s=600.0, fetchers=4, window=4)
    prompt = list(range(100, 132))  # 8 blocks of 4
    s = Scheduler(
        SchedulerConfig(
            num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64
        )
    )
    s.kv.pool.evicted = []
    s.tier_prefix = TierPrefix(loader.start, loader.wait)
    s.add_request(_req("a", prompt + [7], 3))
    out = s.schedule()
    for _ in range(500):
        if out.requests:
            break
        out = s.schedule()
    assert [t.checksum for t in out.tier_loads] == list(range(1, 9))  # chain order
    assert out.requests[0].positions.start == 32
    assert not tier.barrier.broken


def test_two_requests_load_side_by_side():
    gated = FakeTier(stored=3)  # request a's tier hangs until the gate opens
    free = FakeTier(stored=3, base=200)
    free.gate.set()
    route = {100: gated, 200: free}

    def load_one(ident: BlockIdentity) -> LoadedBlock | None:
        first = struct.unpack_from("<I", ident.token_bytes)[0]
        return route[first // 100 * 100].load_one(ident)

    loader = TierLoader(load_one, stall_timeout_s=600.0, threads=2)
    a = loader.start([_ident(100)])
    b = loader.start([_ident(200)])
    assert b.done.wait(10) and len(b.result()) == 1  # not queued behind a's hung load
    assert not a.done.is_set()
    gated.gate.set()
    assert a.done.wait(10) and len(a.result()) == 1


def _ident(first_token: int) -> BlockIdentity:
    tokens = struct.pack("<4I", *range(first_token, first_token + 4))
    return BlockIdentity(bytes(32), None, tokens)


def test_a_loader_takes_nothing_past_the_first_miss():
    tier = FakeTier(stored=2)
    tier.gate.set()
    accounted: list[int | None] = []
    loader = TierLoader(
        tier.load_one,
        stall_timeout_s=600.0,
        account=lambda b, _s: accounted.append(None if b is None else b.checksum),
    )
    job = loader.start([_ident(100 + 4 * i) for i in range(6)])
    assert job.done.wait(10)
    assert [b.checksum for b in job.result()] == [1, 2]
    time.sleep(0.05)  # fetches past the miss may finish: they are not counted
    assert accounted == [1, 2, None]
