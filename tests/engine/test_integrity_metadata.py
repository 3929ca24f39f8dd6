"""Metadata faults on a stepping engine: foreign-thread mutations, a coherent wrong block
reference, a held block on the free queue. Each must leave outputs as in the fault-free
run and the pool whole (every block free, cached-free, quarantined, retired or reserved).

Runs over ``KVEchoModel`` (real scheduler, KV store, runner and guard; reads through the
attention metadata's ``block_index``).
"""

from __future__ import annotations

import inspect
import random
import threading

import pytest
from kv_echo_model import echo_engine, run_to_completion

from pagewarden.faults.foreign import call_from_thread, foreign_calls, state_fingerprint
from pagewarden.faults.injector import FaultInjector
from pagewarden.kv.block import BlockRef, BlockState
from pagewarden.kv.block_pool import BlockPool
from pagewarden.kv.errors import KVOwnershipError
from pagewarden.kv.kv_manager import KVCacheManager
from pagewarden.kv.swap_space import SwapSpace
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.output import FailureKey
from pagewarden.sched.scheduler import Scheduler
from pagewarden.worker.step_hooks import StepHooks

#: Public methods that only read state; every other public method is a mutator.
QUERIES = {
    Scheduler: {
        "has_unfinished_requests",
        "stats",
        "check_invariants",
        "quarantined_block_ids",
        "usable_blocks",
        "admission_limits",
    },
    KVCacheManager: {
        "has_table",
        "block_ids",
        "block_refs",
        "resolve",
        "slot_mapping",
        "is_swapped",
        "first_unsound_block",
        "holders",
        "check_invariants",
        "held_counts",
        "overshared_blocks",
        "refcount_mismatches",
    },
    BlockPool: {"check_owner", "get_cached_block", "state_counts"},
    SwapSpace: {"check_invariants"},
}


def _workload(seed: int, num: int):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(10)] for _ in range(2)]
    return [
        (
            prefixes[i % 2] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 9))],
            SamplingParams(
                temperature=0.0, max_tokens=12, ignore_eos=True, n=2 if i % 3 == 2 else 1
            ),
        )
        for i in range(num)
    ]


def _engine(tiny_llama_dir, integrity: str, **kw):
    kw.setdefault("num_kv_blocks", 48)
    return echo_engine(
        tiny_llama_dir, block_size=4, integrity=integrity, max_num_batched_tokens=64, **kw
    )


def _submit(engine, workload) -> None:
    for i, (ids, params) in enumerate(workload):
        engine.add_request(str(i), ids, params)


def _assert_pool_whole(engine) -> None:
    pool = engine.scheduler.kv.pool
    assert engine.stats().used_blocks == 0
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    allowed = {BlockState.FREE, BlockState.CACHED_FREE, BlockState.QUARANTINED}
    assert all(b.state in allowed for b in pool.blocks[1:])
    assert engine.scheduler.check_invariants() == []


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    cache = {}

    def get(seed: int, num: int = 10, **kw):
        key = (seed, num, tuple(sorted(kw.items())))
        if key not in cache:
            engine = _engine(tiny_llama_dir, "off", **kw)
            _submit(engine, _workload(seed, num))
            cache[key] = run_to_completion(engine)
        return cache[key]

    return get


# ------------------------------------------------------------------ foreign threads
def test_the_foreign_call_table_covers_every_public_mutator(tiny_llama_dir) -> None:
    """A mutator added later without a foreign-thread case fails here."""
    engine = _engine(tiny_llama_dir, "audit")
    covered: dict[type, set[str]] = {cls: set() for cls in QUERIES}
    by_name = {cls.__name__: cls for cls in QUERIES}
    for call in foreign_calls(engine.scheduler):
        covered[by_name[call.owner]].add(call.method)
    for cls, queries in QUERIES.items():
        public = {
            name
            for name, member in inspect.getmembers(cls)
            if not name.startswith("_") and callable(member) and not isinstance(member, type)
        }
        assert public - queries == covered[cls], cls.__name__


def test_every_mutator_from_a_foreign_thread_changes_nothing(tiny_llama_dir, reference) -> None:
    engine = _engine(tiny_llama_dir, "strict", num_swap_blocks=24, num_kv_blocks=40)
    _submit(engine, _workload(0, 10))
    tried = 0
    outputs: dict[str, list[list[int]]] = {}
    step = 0
    while engine.has_unfinished():
        if step in (2, 7, 15) and engine.scheduler.running:
            for call in foreign_calls(engine.scheduler):
                before = state_fingerprint(engine.scheduler)
                error = call_from_thread(call.fn)
                assert isinstance(error, KVOwnershipError), (call.owner, call.method, error)
                assert state_fingerprint(engine.scheduler) == before, (call.owner, call.method)
                tried += 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]
        step += 1
    assert tried == 3 * len(foreign_calls(engine.scheduler))
    assert engine.stats().integrity.ownership_violations == tried
    assert outputs == reference(0, num_kv_blocks=40)
    _assert_pool_whole(engine)


def test_mutators_hammered_from_a_thread_while_the_engine_steps(tiny_llama_dir, reference) -> None:
    engine = _engine(tiny_llama_dir, "strict")
    _submit(engine, _workload(0, 10))
    engine.step()  # the main thread owns the state from here on
    stop = threading.Event()
    refused: list[str] = []
    wrong: list[str] = []

    def hammer() -> None:
        while not stop.wait(0.001):  # a breath between rounds: the engine keeps the GIL
            try:
                calls = foreign_calls(engine.scheduler)
            except (KeyError, IndexError, RuntimeError):  # state moved while it was read
                continue
            for call in calls:
                try:
                    call.fn()
                    wrong.append(f"{call.owner}.{call.method} ran")
                except KVOwnershipError:
                    refused.append(call.method)
                except Exception as exc:  # any other outcome is a failure of the check
                    wrong.append(f"{call.owner}.{call.method}: {exc!r}")

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        outputs = run_to_completion(engine)
    finally:
        stop.set()
        thread.join()
    assert not wrong, wrong[:5]
    assert len(refused) > len(set(refused))  # refused again and again, not in one round
    assert outputs == reference(0)
    _assert_pool_whole(engine)


# ------------------------------------------------------------ coherent wrong reference
def test_recovery_after_a_coherent_wrong_reference_leaks_no_block(tiny_llama_dir, reference):
    engine = _engine(tiny_llama_dir, "strict")
    _submit(engine, _workload(0, 10))
    injector = FaultInjector(engine, seed=3)
    injected = []
    step = 0
    outputs: dict[str, list[list[int]]] = {}
    while engine.has_unfinished():
        if step in (3, 9, 15, 21) and engine.scheduler.running:
            injected.append(injector.inject("coherent_wrong_ref"))
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]
        step += 1
    applied = [f for f in injected if f is not None]
    assert len(applied) >= 3
    assert all(f.detected and f.delay == 0 for f in applied), applied
    assert injector.corrupted_tokens == 0
    assert outputs == reference(0)
    _assert_pool_whole(engine)


def test_a_wrong_reference_tags_cannot_see_is_repaired_by_the_audit(tiny_llama_dir) -> None:
    """Two requests with the same prompt and no prefix cache hold identical blocks; an
    entry rewritten to the other's block reads correct K/V, so only the reference counts
    show it. The audit fails, and its repair quarantines, rolls back and frees."""
    engine = _engine(tiny_llama_dir, "audit", audit_interval=1, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt = list(range(20, 31))
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt, params)
    outputs: dict[str, list[int]] = {}
    for _ in range(2):
        for out in engine.step():
            outputs.update({out.request_id: list(out.outputs[0].token_ids)} if out.finished else {})
    kv = engine.scheduler.kv
    a, b = kv.tables["a"], kv.tables["b"]
    own, other = a.ids[0], b.ids[0]
    a.refs[0] = BlockRef(other, kv.pool.blocks[other].epoch)
    a.ids = [other] + a.ids[1:]
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    s = engine.stats().integrity
    assert s.failures.get(FailureKey("refcount", "audit"), 0) >= 1
    assert s.invariant_violations >= 1  # found once, then repaired
    assert kv.pool.blocks[own].ref_cnt == 0  # the orphaned block went back
    assert outputs["a"] == outputs["b"]  # same prompt, greedy: the same output
    _assert_pool_whole(engine)


# ------------------------------------------------------------ held block, free queue
class _Watch(StepHooks):
    """Records, just before each forward pass, whether ``block`` sits on the free queue
    and who holds it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.block: int | None = None
        self.seen: list[tuple[bool, dict[str, int]]] = []

    def before_execute(self, out):
        if self.block is not None:
            kv = self.engine.scheduler.kv
            b = kv.pool.blocks[self.block]
            self.seen.append((b.prev_free is not None, kv.holders({self.block})))
        return out


@pytest.mark.parametrize("level", ["audit", "standard", "strict"])
def test_held_block_on_the_free_queue_is_caught_before_the_forward_pass(
    tiny_llama_dir, reference, level
) -> None:
    engine = _engine(tiny_llama_dir, level)
    watch = _Watch(engine)
    engine.install_hooks(watch)
    _submit(engine, _workload(0, 10))
    outputs: dict[str, list[list[int]]] = {}
    step = 0
    while engine.has_unfinished():
        if step == 4:
            kv = engine.scheduler.kv
            rid = engine.scheduler.running[0].req_id
            watch.block = kv.tables[rid].ids[0]
            holders = kv.holders({watch.block})
            # The bug: linked at the head of the free queue (next to be handed out).
            kv.pool.free_queue.appendleft(kv.pool.blocks[watch.block])
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]
        step += 1
    linked, holders_then = watch.seen[0]
    assert not linked  # taken off the queue before the very next forward pass
    assert holders_then == holders  # and handed to nobody else
    s = engine.stats().integrity
    assert s.failures[FailureKey("free_list", "schedule")] == 1  # one repair serves every holder
    assert s.rolled_back_requests == 0
    assert outputs == reference(0)
    _assert_pool_whole(engine)


def test_the_pool_never_hands_out_a_held_block() -> None:
    pool = BlockPool(6, 4)
    (held,) = pool.get_new_blocks(1)
    pool.free_queue.appendleft(held)  # the bug
    got = pool.get_new_blocks(2)
    assert held not in got and held.ref_cnt == 1 and held.state is BlockState.USED
    assert held.prev_free is None and pool.held_blocks_skipped == 1
