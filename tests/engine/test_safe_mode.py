"""Safe mode on a live engine: injected faults switch it to ``safe`` between two steps
and the clean period switches it back through the batch controller, with outputs equal
to the fault-free run; operators switch profiles by hand; ``--profile`` starts in one."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest
import torch

from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core import EngineCore
from pagewarden.engine.profiles import ProfileError
from pagewarden.faults.injector import FaultInjector
from pagewarden.faults.metadata_faults import METADATA_FAULTS
from pagewarden.models.loader import load_model
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.replay import load_record, replay


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir, torch.float32)


RECORDS = Path(tempfile.mkdtemp(prefix="pagewarden-test-safe-mode-"))


def _config(**kw) -> EngineConfig:
    base = dict(
        model="tiny",
        dtype="float32",
        block_size=4,
        num_kv_blocks=160,
        num_swap_blocks=32,
        integrity="standard",
        max_num_seqs=8,
        target_itl_ms=60_000.0,  # only faults move the batch here
        safe_mode_faults=2,
        safe_mode_window=10.0,
        safe_mode_clean_period=2.0,
        flight_recorder_steps=64,
        flight_recorder_dir=str(RECORDS),
    )
    base.update(kw)
    return EngineConfig(**base)


class StepClock:
    """Engine time that advances 0.1 s per step: the test does not depend on speed."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _run(loaded, faults: list[tuple[int, str]]):
    engine = EngineCore(_config(), loaded)
    clock = StepClock()
    engine.safe_mode.controller.clock = clock
    injector = FaultInjector(engine, seed=3) if faults else None
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    for i in range(10):
        engine.add_request(str(i), [rng.randrange(3, 500) for _ in range(9 + 2 * i)], params)
    trace, outputs, plan, step = [], {}, list(faults), 0
    while engine.has_unfinished():
        while injector is not None and plan and plan[0][0] <= step:
            if injector.inject(plan[0][1]) is None:
                break
            plan.pop(0)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        guard, sched = engine.runner.guard, engine.scheduler
        trace.append(
            (engine.safe_mode.controller.active, sched.max_num_seqs, guard.level,
             sched.preemption_mode, guard.scrub_blocks_per_step)
        )  # fmt: skip
        clock.t += 0.1
        step += 1
    return engine, injector, trace, outputs


def test_a_fault_burst_switches_to_safe_and_back_with_identical_outputs(loaded) -> None:
    _, _, clean_trace, clean = _run(loaded, [])
    assert {t[0] for t in clean_trace} == {"normal"}
    engine, injector, trace, outputs = _run(
        loaded, [(4, "index_redirect"), (5, "index_redirect"), (6, "table_redirect")]
    )
    assert outputs == clean
    assert injector is not None and all(f.detected for f in injector.faults)
    profiles = [t[0] for t in trace]
    first_safe = profiles.index("safe")
    back = profiles.index("normal", first_safe)
    assert set(profiles[:first_safe]) == {"normal"} and first_safe <= 8
    # In safe: strict checks, the batch floor (8 // 4), no swapping, a faster scrubber.
    assert set(trace[first_safe:back]) == {("safe", 2, "strict", "recompute", 16)}
    # Back to the configured settings, except the batch: it climbs from the floor.
    after = trace[back:]
    assert {t[2:] for t in after} == {("standard", "swap", 4)}
    seats = [t[1] for t in after]
    assert seats[0] == 2 and max(seats) > 2 and seats == sorted(seats)
    stats = engine.stats()
    assert stats.profile.active == "normal"
    assert stats.profile.switches == {
        ("normal", "safe", "fault_burst"): 1,
        ("safe", "normal", "clean_period"): 1,
    }
    assert stats.integrity.level == "standard" and stats.integrity.failed_requests == 0
    # Each switch wrote a flight record, and the records replay through the switches'
    # own scheduler calls (batch limits, preemption mode, dropped prefix entries).
    recorder = engine.recorder
    assert recorder is not None
    recorder.close()
    reasons = [load_record(p).header["reason"] for p in recorder.dumps]
    assert any("profile normal -> safe (fault_burst)" in r for r in reasons), reasons
    assert any("profile safe -> normal (clean_period)" in r for r in reasons), reasons
    for path in recorder.dumps:
        result = replay(load_record(path), METADATA_FAULTS)
        assert result.divergence is None, (path, result.divergence)


def test_an_operator_switch_applies_at_the_next_step_even_when_idle(loaded) -> None:
    engine = EngineCore(_config(), loaded)
    engine.request_profile("safe")
    assert engine.has_unfinished()  # the idle loop steps once to apply it
    engine.step()
    assert not engine.has_unfinished()
    state = engine.stats().profile
    assert (state.active, state.reason) == ("safe", "operator")
    assert engine.runner.guard.level == "strict" and engine.scheduler.max_num_seqs == 2
    with pytest.raises(ProfileError, match="unknown profile"):
        engine.request_profile("turbo")


def test_start_in_a_user_profile_from_a_file(loaded, tmp_path) -> None:
    path = tmp_path / "profiles.json"
    path.write_text('{"profiles": {"cautious": {"max_num_seqs": 4, "audit_interval": 16}}}')
    engine = EngineCore(_config(profile="cautious", profiles_file=str(path)), loaded)
    state = engine.stats().profile
    assert state.active == "cautious" and state.profiles == ("normal", "safe", "cautious")
    assert engine.scheduler.max_num_seqs == 4 and engine.integrity.audit_interval == 16
    with pytest.raises(ProfileError, match="unknown profile"):
        EngineCore(_config(profile="turbo"), loaded)


def test_a_failed_audit_switches_to_safe_at_once(loaded) -> None:
    engine = EngineCore(_config(audit_interval=1), loaded)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), [5 + i] * 9, params)
    engine.step()
    held = engine.scheduler.kv.tables["0"].ids[0]
    engine.scheduler.kv.pool.blocks[held].ref_cnt += 1  # a reference nobody holds
    engine.step()  # the audit after this step finds it, repairs it, and rolls back
    state = engine.stats().profile
    assert (state.active, state.reason) == ("safe", "invariant_violation")
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
    assert finished == {"0": "length", "1": "length", "2": "length"}
    assert engine.scheduler.check_invariants() == []
