"""The integrity layer wired into the engine: each detector fires on its fault, stays
silent on clean runs, and recovery reproduces the fault-free output.

Most tests run the real scheduler, KV store, runner and guard over ``KVEchoModel``
(real K/V writes and reads, no network), so thousands of steps take seconds.
"""

from __future__ import annotations

import random
import threading

import pytest
from kv_echo_model import echo_engine, run_to_completion

from pagewarden import LLM
from pagewarden.engine.config import EngineConfigError
from pagewarden.engine.core import RequestRejected
from pagewarden.faults.injector import FAULT_KINDS, FaultInjector
from pagewarden.kv.errors import KVOwnershipError
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.output import FailureKey


def _workload(seed: int, num: int, max_tokens: int = 12):
    """Requests over two shared prefixes; every third one with n = 2."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(10)] for _ in range(2)]
    return [
        (
            prefixes[i % 2] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 9))],
            SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=2 if i % 3 == 2 else 1
            ),
        )
        for i in range(num)
    ]


def _engine(tiny_llama_dir, integrity: str, num_kv_blocks: int = 48, **kw):
    return echo_engine(
        tiny_llama_dir,
        block_size=4,
        num_kv_blocks=num_kv_blocks,
        integrity=integrity,
        max_num_batched_tokens=64,
        **kw,
    )


def _submit(engine, workload) -> None:
    for i, (ids, params) in enumerate(workload):
        engine.add_request(str(i), ids, params)


def _assert_pool_clean(engine) -> None:
    stats = engine.stats()
    assert stats.used_blocks == 0
    assert engine.scheduler.check_invariants() == []


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Fault-free outputs of the workload (integrity off), per seed."""
    cache = {}

    def get(seed: int, num: int = 10):
        if (seed, num) not in cache:
            engine = _engine(tiny_llama_dir, "off")
            _submit(engine, _workload(seed, num))
            cache[(seed, num)] = run_to_completion(engine)
        return cache[(seed, num)]

    return get


def test_echo_model_reads_what_it_wrote(tiny_llama_dir, reference) -> None:
    """Sanity of the harness: output depends on the KV read, and is reproducible."""
    engine = _engine(tiny_llama_dir, "strict")
    _submit(engine, _workload(0, 10))
    assert run_to_completion(engine) == reference(0)
    assert engine.stats().num_preemptions > 0
    assert engine.stats().prefix_cache_hits > 0
    _assert_pool_clean(engine)


def test_no_false_positives_over_10k_clean_steps(tiny_llama_dir) -> None:
    """Strict checks everything a step reads; 10,000 clean steps must raise nothing."""
    engine = _engine(tiny_llama_dir, "strict", num_kv_blocks=40, audit_interval=50)
    rng = random.Random(1)
    steps = 0
    next_id = 0
    while steps < 10_000:
        while len(engine.scheduler.waiting) + len(engine.scheduler.running) < 6:
            ids = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 14))]
            if rng.random() < 0.5:
                ids = [7, 8, 9, 10, 11, 12, 13, 14] + ids  # shared prefix
            params = SamplingParams(
                temperature=0.0,
                max_tokens=rng.randrange(1, 40),
                ignore_eos=True,
                n=rng.choice([1, 1, 2]),
            )
            engine.add_request(f"r{next_id}", ids, params)
            next_id += 1
            engine._apply_pending()
        if rng.random() < 0.02 and engine.scheduler.running:
            engine.abort_request(rng.choice(engine.scheduler.running).req_id.split("#")[0])
        engine.step()
        steps += 1
    s = engine.stats()
    assert s.integrity.failures == {}, s.integrity.failures
    assert s.integrity.invariant_violations == 0
    assert s.integrity.audits >= 10_000 // 50
    assert s.integrity.tag_checks > 100_000 and s.integrity.block_verifies > 10_000
    assert s.integrity.scrubbed_blocks > 0 and s.integrity.seals > 1000
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0
    assert engine.scheduler.check_invariants() == []


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_each_detector_fires_and_recovery_matches_fault_free(
    tiny_llama_dir, reference, kind: str
) -> None:
    swap = kind == "swap_corruption"
    # A host tier for the swap fault (preemption then swaps instead of recomputing).
    engine = _engine(tiny_llama_dir, "strict", num_swap_blocks=24 if swap else None)
    _submit(engine, _workload(0, 10))
    injector = FaultInjector(engine, seed=3)
    injected = []
    outputs: dict[str, list[list[int]]] = {}
    step = 0
    # A swap fault waits for a swapped-out request: offer it more chances.
    fault_steps = range(3, 60, 3) if swap else (3, 9, 15, 21)
    while engine.has_unfinished():
        if (
            step in fault_steps
            and engine.scheduler.running
            and (not swap or len(injector.faults) < 4)
        ):
            injected.append(injector.inject(kind))
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]
        step += 1
    applied = [f for f in injected if f not in injector.pending_faults]
    assert len(applied) >= 3, applied
    for f in applied:
        assert f.detected, f"{kind} not detected: {f}"
        if swap:  # it sits in host memory until swapped in, and is caught on arrival
            assert f.found_by == "checksum/swap_in", f
        else:
            assert f.delay == 0, f"{kind} detected {f.delay} steps late: {f}"
    assert injector.corrupted_tokens == 0
    assert outputs == reference(0)
    s = engine.stats().integrity
    assert s.failed_requests == 0
    if kind == "foreign_thread":
        assert s.ownership_violations == len(applied)
    elif kind == "free_list_push":
        # Caught before any allocation could hand it out: K/V intact, nothing recomputed.
        assert s.failures[FailureKey("free_list", "schedule")] == len(applied)
        assert s.rolled_back_requests == 0
    else:
        # One recovery per step that found faults (faults found together recover together).
        assert s.recoveries >= len({f.detected_step for f in applied})
        assert s.rolled_back_requests >= 1
    _assert_pool_clean(engine)


def test_standard_finds_sealed_flips_by_scrub_within_bounded_steps(tiny_llama_dir) -> None:
    """Standard does not verify every read: a flipped sealed block that its holder keeps
    reading is found by the scrubber, within ceil(sealed / per_step) steps."""
    engine = _engine(tiny_llama_dir, "standard", scrub_blocks_per_step=2)
    _submit(engine, _workload(2, 10, max_tokens=30))
    injector = FaultInjector(engine, seed=5)
    step, injected = 0, []
    while engine.has_unfinished():
        if step in (4, 12, 20) and engine.scheduler.running:
            injected.append(injector.inject("sealed_bitflip"))
        engine.step()
        step += 1
    applied = [f for f in injected if f not in injector.pending_faults]
    assert applied
    bound = (engine.kv_store.shape.num_blocks + 1) // 2
    for f in applied:
        assert f.detected or not f.live_blocks, f
        if f.detected:
            assert f.found_by in ("checksum/scrub", "checksum/reuse"), f
            assert f.delay <= bound
    _assert_pool_clean(engine)


def test_reuse_of_a_corrupted_prefix_block_is_caught_before_the_hit_is_read(tiny_llama_dir) -> None:
    engine = _engine(tiny_llama_dir, "standard", scrub_blocks_per_step=0)
    prefix = list(range(20, 36))  # 4 full blocks
    engine.add_request(
        "a", prefix + [40], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    )
    run_to_completion(engine)
    cached = [b.block_id for b in engine.scheduler.kv.pool.blocks if b.block_hash is not None]
    assert cached
    from pagewarden.faults.kv_faults import flip_bit

    flip_bit(engine.kv_store.caches, cached[0], 0, random.Random(0))
    engine.add_request(
        "b", prefix + [41], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    )
    run_to_completion(engine)
    s = engine.stats().integrity
    assert s.failures.get(("checksum", "reuse")) == 1
    assert s.quarantined_blocks == 1 and s.quarantine_releases == 1
    _assert_pool_clean(engine)


def test_foreign_thread_mutation_raises_and_is_counted(tiny_llama_dir) -> None:
    engine = _engine(tiny_llama_dir, "audit")
    engine.add_request(
        "a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )
    engine.step()  # this thread now owns the state
    errors = []

    def mutate() -> None:
        for call in (
            lambda: engine.scheduler.kv.pool.get_new_blocks(1),
            lambda: engine.scheduler.schedule(),
            lambda: engine.scheduler.abort_requests(["a"]),
        ):
            try:
                call()
            except KVOwnershipError as exc:
                errors.append(exc)

    t = threading.Thread(target=mutate)
    t.start()
    t.join()
    assert len(errors) == 3
    assert "engine-core thread" in str(errors[0])
    assert engine.stats().integrity.ownership_violations == 3
    run_to_completion(engine)
    _assert_pool_clean(engine)


def test_unrecoverable_fault_fails_the_request_with_a_clear_reason(tiny_llama_dir) -> None:
    """A request that needs every usable block cannot survive a block being retired."""
    engine = _engine(tiny_llama_dir, "strict", num_kv_blocks=6)  # 5 usable blocks of 4
    engine.add_request(
        "big", [5] * 10, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    )
    engine.add_request(
        "small", [6] * 3, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    )
    outputs = {}
    for _ in range(2):
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    pool = engine.scheduler.kv.pool
    spare = next(iter(pool.free_queue))
    for _ in range(3):  # a block that failed three checks: retired
        pool.quarantine(spare.block_id)
    assert spare.block_id in pool.retired
    injector = FaultInjector(engine, seed=0)
    injector.inject("sealed_bitflip")
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    assert outputs["big"].outputs[0].finish_reason == "error"
    assert outputs["small"].outputs[0].finish_reason == "length"
    s = engine.stats().integrity
    assert s.failed_requests == 1 and s.retired_blocks == 1
    assert engine.stats().used_blocks == 0
    assert engine.scheduler.check_invariants() == []
    # The pool is smaller now: the same request is refused up front with a clear error...
    with pytest.raises(RequestRejected, match="needs up to 5 KV blocks"):
        engine.add_request("again", [5] * 10, SamplingParams(max_tokens=10, ignore_eos=True))
    # ... and one accepted before a block retired fails at admission instead of hanging.
    engine.add_request("racing", [5] * 6, SamplingParams(max_tokens=8, ignore_eos=True))
    other = next(b for b in pool.free_queue if b.block_id != spare.block_id)
    for _ in range(3):
        pool.quarantine(other.block_id)
    (out,) = engine.step()
    assert out.request_id == "racing" and out.outputs[0].finish_reason == "error"
    assert not engine.has_unfinished() and engine.scheduler.check_invariants() == []


def test_integrity_level_is_validated() -> None:
    with pytest.raises(EngineConfigError, match="integrity"):
        LLM(model="unused", integrity="paranoid")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(swap_space=-1.0), "swap_space"),
        (dict(num_swap_blocks=-2), "num_swap_blocks"),
        (dict(swap_space=1.0, num_swap_blocks=4), "not both"),
        (dict(preemption_mode="spill"), "preemption_mode"),
        (dict(preemption_mode="swap"), "host tier"),
    ],
)
def test_swap_arguments_are_validated(kw, match) -> None:
    with pytest.raises(EngineConfigError, match=match):
        LLM(model="unused", **kw)
