"""The adaptive batch controller wired into the engine: a detected fault lowers the
scheduler's batch limits at once, outputs stay those of the fault-free run, a clean
window raises the limits back, and ``--no-adaptive-batch`` leaves them alone."""

from __future__ import annotations

import random

import pytest
import torch

from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core import EngineCore
from pagewarden.models.loader import load_model
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.config import SchedulerConfig
from pagewarden.sched.request import Request
from pagewarden.sched.scheduler import Scheduler
from pagewarden.worker.step_hooks import StepHooks

BLOCK = 4


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir, torch.float32)


class _RedirectOnce(StepHooks):
    """Points one context block of the first long-enough request at another request's
    block in the ``at``-th forward call's ``block_index``."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def on_attention_metadata(self, out, meta) -> None:
        self.calls += 1
        if self.calls != self.at:
            return
        reqs = out.requests
        k = next(i for i, r in enumerate(reqs) if r.positions.start >= 2 * BLOCK)
        other = next(r for i, r in enumerate(reqs) if i != k and r.positions.start >= BLOCK)
        index = meta.block_index.clone()
        index[k * meta.max_blocks + 1] = other.block_table[0]
        meta.block_index = index


def _run(loaded, adaptive: bool, hooks: StepHooks | None):
    config = EngineConfig(
        model="tiny",
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=96,
        integrity="strict",
        enable_prefix_caching=False,
        max_num_seqs=8,
        adaptive_batch=adaptive,
        target_itl_ms=60_000.0,  # latency never triggers here: only the fault does
    )
    engine = EngineCore(config, loaded)
    engine.install_hooks(hooks)
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(6):
        prompt = [rng.randrange(3, 500) for _ in range(9 + 2 * i)]
        engine.add_request(str(i), prompt, params)
    limits, outputs = [], {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        limits.append(engine.scheduler.max_num_seqs)
    return limits, outputs, engine


def test_a_detected_fault_halves_the_batch_and_outputs_match(loaded):
    clean_limits, clean, _ = _run(loaded, True, None)
    assert set(clean_limits) == {8}  # nothing to react to
    limits, outputs, engine = _run(loaded, True, _RedirectOnce(at=4))
    assert outputs == clean
    assert 4 in limits and min(limits) == 4  # halved once, never below the floor (2)
    first = limits.index(4)
    assert set(limits[:first]) == {8}
    stats = engine.stats()
    assert stats.batch_limit_changes.get("integrity_fault") == 1
    assert stats.integrity.recoveries >= 1


def test_no_adaptive_batch_keeps_the_configured_limit(loaded):
    limits, _, engine = _run(loaded, False, _RedirectOnce(at=4))
    assert set(limits) == {8}
    assert engine.stats().batch_limit_changes == {}
    assert engine.stats().integrity.recoveries >= 1


def test_a_lowered_seat_limit_keeps_running_requests_and_admits_nobody_new():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4))
    sched.claim_ownership()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(5):
        sched.add_request(Request(str(i), [5, 6, 7], params))
    first = sched.schedule()
    assert len(first.requests) == 4
    sched.set_batch_limits(2, 2048)
    second = sched.schedule()
    assert [r.req_id for r in second.requests] == ["0", "1"]
    assert len(sched.running) == 4 and len(sched.waiting) == 1  # nobody dropped
    assert sched.stats().effective_max_num_seqs == 2
    with pytest.raises(ValueError):
        sched.set_batch_limits(5, 2048)  # above the configured maximum
    with pytest.raises(ValueError):
        sched.set_batch_limits(2, 0)


def test_latency_rule_reads_all_decode_steps_only(loaded):
    """A step that prefills beside running decodes is slow by its token budget, not by
    the batch size: it feeds no inter-token samples, so a tight target does not cut the
    batch for it; all-decode steps still do."""
    config = EngineConfig(
        model="tiny",
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=96,
        enable_prefix_caching=False,
        max_num_seqs=8,
        adaptive_batch=True,
        target_itl_ms=1e-6,  # every sample is over it
    )
    engine = EngineCore(config, loaded)
    assert engine.batch is not None
    fed: list[int] = []
    observe = engine.batch.observe
    engine.batch.observe = lambda s: fed.append(len(s.inter_token_latencies_s)) or observe(s)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    rng = random.Random(2)
    for i in range(4):
        engine.add_request(str(i), [rng.randrange(3, 500) for _ in range(8)], params)
    engine.step()  # prefill only
    engine.step()  # 4 decodes
    engine.add_request("late", [rng.randrange(3, 500) for _ in range(8)], params)
    engine.step()  # 4 decodes + one prefill
    assert fed == [0, 4, 0]
    for _ in range(30):
        engine.step()
    assert engine.batch.changes.get("latency", 0) >= 1  # decode steps still count
