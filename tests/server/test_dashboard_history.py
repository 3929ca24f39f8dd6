"""The dashboard's time series: rates and latency percentiles from stats snapshots."""

from __future__ import annotations

import dataclasses

import pytest

from pagewarden.engine.core import EngineStats
from pagewarden.engine.integrity import IntegrityStats
from pagewarden.metrics.stats import FrontendStatsRecorder, Histogram
from pagewarden.sched.output import FailureKey
from pagewarden.server.dashboard_history import DashboardHistory, percentile, profile_name


def test_percentile_interpolates_inside_the_bucket_of_the_window() -> None:
    h = Histogram(buckets=(0.1, 0.2, 0.4))
    h.observe(0.05)  # before the window
    old = h.snapshot()
    for v in (0.15, 0.15, 0.3, 0.3):
        h.observe(v)
    new = h.snapshot()
    assert percentile(new, old, 0.5) == pytest.approx(0.2)  # 2 of 4 in (0.1, 0.2]
    assert percentile(new, old, 1.0) == pytest.approx(0.4)
    assert percentile(old, old, 0.5) is None


def _stats(**kw) -> EngineStats:
    integrity = IntegrityStats("standard", 0, 0, 0, 0, 0, 0, 0)
    integrity = dataclasses.replace(integrity, **kw.pop("integrity", {}))
    return EngineStats(total_blocks=11, integrity=integrity, **kw)


def test_samples_turn_counters_into_rates_and_keep_failure_kinds() -> None:
    history, frontend = DashboardHistory(), FrontendStatsRecorder()
    history.sample(None, frontend.snapshot(), now=0.0)  # no engine stats yet: skipped
    history.sample(_stats(generation_tokens=10, used_blocks=5), frontend.snapshot(), now=1.0)
    frontend.first_token(0.03, 0.01)
    frontend.admission_rejected()
    failures = {FailureKey("checksum", "scrub"): 2}
    later = _stats(
        generation_tokens=50,
        used_blocks=2,
        num_preemptions=1,
        integrity={"failures": failures, "recoveries": 2},
    )
    history.sample(later, frontend.snapshot(), now=3.0)
    s = history.series()
    assert s["kv_usage"] == [0.5, 0.2]
    assert s["generation_tps"] == [0.0, 20.0]  # 40 tokens in 2 s
    assert s["admission_rejections_ps"] == [0.0, 0.5]
    assert s["preemptions"] == [0, 1] and s["recoveries"] == [0, 2]
    assert s["failures"] == {"checksum/scrub": [0, 2]}
    assert s["ttft_p50_ms"][0] is None and 20 < s["ttft_p50_ms"][1] <= 40
    assert s["profile"] == ["normal", "normal"]


def test_profile_name_reads_what_the_engine_reports() -> None:
    assert profile_name(None) == "normal"

    class WithProfile:
        profile = "safe"

    assert profile_name(WithProfile()) == "safe"
