"""The adaptive batch controller on its own: plain numbers in, limits out (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagewarden.engine.batch_controller import (
    AdaptiveBatchController,
    BatchControllerConfig,
    BatchLimits,
    StepSignals,
)


def make(**overrides) -> AdaptiveBatchController:
    cfg = dict(max_num_seqs=32, max_num_batched_tokens=2048, window_steps=4, target_itl_s=0.1)
    cfg.update(overrides)
    return AdaptiveBatchController(BatchControllerConfig(**cfg))


def calm(ctl: AdaptiveBatchController, steps: int) -> list:
    fast = (0.01,) * 20
    return [ctl.observe(StepSignals(inter_token_latencies_s=fast)) for _ in range(steps)]


def test_fault_halves_the_batch_and_the_token_budget_follows():
    ctl = make()
    change = ctl.observe(StepSignals(integrity_faults=1))
    assert change is not None and change.reason == "integrity_fault"
    assert change.old == BatchLimits(32, 2048)
    assert change.new == BatchLimits(16, 1024)
    assert ctl.limits == BatchLimits(16, 1024)


def test_decrease_stops_at_the_floor():
    ctl = make()
    for _ in range(10):
        ctl.observe(StepSignals(integrity_faults=1))
    assert ctl.limits == BatchLimits(8, 512)  # a quarter of the maximum by default
    assert ctl.observe(StepSignals(integrity_faults=1)) is None  # no change below the floor


def test_explicit_floor():
    ctl = make(min_num_seqs=12, min_num_batched_tokens=1000)
    for _ in range(5):
        ctl.observe(StepSignals(integrity_faults=2))
    assert ctl.limits == BatchLimits(12, 1000)


def test_additive_increase_after_a_clean_window_back_to_the_maximum():
    ctl = make()
    ctl.observe(StepSignals(integrity_faults=1))  # 16
    changes = [c for c in calm(ctl, 4) if c is not None]
    assert [c.new.max_num_seqs for c in changes] == [20]  # + max/8 after 4 clean steps
    assert changes[0].reason == "recovery"
    calm(ctl, 4 * 10)
    assert ctl.limits == BatchLimits(32, 2048)  # never above the configured maximum
    assert all(c is None for c in calm(ctl, 8))


def test_slow_tokens_lower_the_batch_once_per_window():
    ctl = make()
    slow = StepSignals(inter_token_latencies_s=(0.5,) * 20)
    first = ctl.observe(slow)
    assert first is not None and first.reason == "latency"
    assert "p90 500.0 ms" in first.detail
    # The window restarted: too few samples yet to judge again.
    assert ctl.observe(StepSignals(inter_token_latencies_s=(0.5,) * 5)) is None
    assert ctl.limits.max_num_seqs == 16


def test_slow_tokens_change_nothing_where_the_lower_limit_would_not_bind():
    ctl = make()  # 32 -> 16 on a decrease
    small = StepSignals(inter_token_latencies_s=(0.5,) * 16)  # a batch of 16: fits in 16
    assert [ctl.observe(small) for _ in range(6)] == [None] * 6
    assert ctl.limits == BatchLimits(32, 2048) and "latency" not in ctl.changes
    # A batch of 17 would be cut by the lower limit: now it decreases.
    change = ctl.observe(StepSignals(inter_token_latencies_s=(0.5,) * 17))
    assert change is not None and change.reason == "latency"
    assert ctl.limits == BatchLimits(16, 1024)
    # Slow again, but with a batch the next cut (8) would not bind: calm, so it climbs.
    small = StepSignals(inter_token_latencies_s=(0.5,) * 8)
    changes = [c for c in (ctl.observe(small) for _ in range(4)) if c is not None]
    assert [(c.reason, c.new.max_num_seqs) for c in changes] == [("recovery", 20)]


def test_latency_needs_enough_samples():
    ctl = make(min_latency_samples=40)
    assert ctl.observe(StepSignals(inter_token_latencies_s=(9.0,) * 20)) is None
    assert ctl.observe(StepSignals(inter_token_latencies_s=(9.0,) * 19)) is None
    assert ctl.observe(StepSignals(inter_token_latencies_s=(9.0,))) is not None


def test_preemption_storm_counts_over_the_window():
    ctl = make(preemption_storm=6)
    assert ctl.observe(StepSignals(preemptions=3)) is None
    change = ctl.observe(StepSignals(preemptions=3))
    assert change is not None and change.reason == "preemption_storm"


def test_target_derived_from_the_first_window_when_not_given():
    ctl = make(target_itl_s=None, baseline_factor=4.0)
    calm(ctl, 4)  # median 10 ms
    assert ctl.target_itl_s == pytest.approx(0.04)
    change = ctl.observe(StepSignals(inter_token_latencies_s=(0.05,) * 20))
    assert change is not None and change.reason == "latency"


def test_derived_targets_are_per_batch_size_class():
    """A target derived at one stream does not judge a full batch: each size class (the
    window's largest decode batch, up to a power of two) gets its own first window."""
    ctl = make(max_num_seqs=64, target_itl_s=None, baseline_factor=4.0, min_latency_samples=1)
    one = StepSignals(inter_token_latencies_s=(0.01,))
    assert [ctl.observe(one) for _ in range(4)] == [None] * 4
    assert ctl.target_itl_s == pytest.approx(0.04)
    full = StepSignals(inter_token_latencies_s=(0.09,) * 64)  # healthy, 9x one stream's
    assert [ctl.observe(full) for _ in range(8)] == [None] * 8
    assert ctl.limits.max_num_seqs == 64 and ctl.target_itl_s == pytest.approx(0.36)
    # 4.4x the full batch's own baseline: slow, and cut
    change = ctl.observe(StepSignals(inter_token_latencies_s=(0.4,) * 64))
    assert change is not None and change.reason == "latency" and "target 360.0 ms" in change.detail
    # one stream is still judged by its own target
    assert ctl.observe(StepSignals(inter_token_latencies_s=(0.05,))) is None  # batch 1 fits
    assert ctl.target_itl_s == pytest.approx(0.04)


def test_operator_force_is_clamped_and_counted():
    ctl = make()
    change = ctl.force(1)
    assert change is not None and change.new.max_num_seqs == 8  # clamped to the floor
    assert ctl.force(1000).new.max_num_seqs == 32
    assert ctl.changes == {"operator": 2}


@pytest.mark.parametrize(
    "bad",
    [
        dict(decrease_factor=1.0),
        dict(window_steps=0),
        dict(target_itl_s=0.0),
        dict(min_num_seqs=64),
    ],
)
def test_bad_config_is_rejected(bad):
    with pytest.raises(ValueError):
        make(**bad)


def test_module_does_not_import_torch():
    code = "import pagewarden.engine.batch_controller, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
