"""Every stats field declared with ``metric(...)`` reaches /metrics and the docs."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pagewarden.engine.core import EngineStats
from pagewarden.engine.integrity import IntegrityStats
from pagewarden.engine.profiles import ProfileState
from pagewarden.metrics.prometheus import build_registry, render
from pagewarden.metrics.stats import FrontendStatsRecorder
from pagewarden.sched.stats import exported_fields

_ROOT = Path(__file__).resolve().parents[2]


def _stats() -> EngineStats:
    """A snapshot whose every int field holds a distinct value."""
    integrity_ints = {f.name: 100 + k for k, f in enumerate(fields(IntegrityStats))}
    integrity_ints.update(level="standard", failures={})
    integrity = IntegrityStats(**integrity_ints)
    labelled = ("integrity", "batch_limit_changes", "profile", "kv_tiers")  # with labels
    ints = {f.name: k + 1 for k, f in enumerate(fields(EngineStats)) if f.name not in labelled}
    profile = ProfileState("safe", switches={("normal", "safe", "fault_burst"): 2})
    return EngineStats(
        **ints, integrity=integrity, batch_limit_changes={"latency": 3}, profile=profile
    )


def _scrape(stats: EngineStats) -> dict[str, float]:
    registry = build_registry(lambda: stats, FrontendStatsRecorder().snapshot, "m")
    text = render(registry)[0].decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if set(sample.labels) == {"model_name"}
    }


def test_every_declared_field_is_exported_with_its_value() -> None:
    stats = _stats()
    scraped = _scrape(stats)
    declared = [*exported_fields(stats), *exported_fields(stats.integrity)]
    assert len(declared) >= 20
    for e in declared:
        name = "pagewarden:" + e.name + ("_total" if e.kind == "counter" else "")
        assert scraped.get(name) == e.value, name


def test_every_exported_metric_is_documented() -> None:
    docs = (_ROOT / "README.md").read_text()
    docs += "".join(p.read_text() for p in sorted((_ROOT / "docs").rglob("*.md")))
    stats = _stats()
    for e in [*exported_fields(stats), *exported_fields(stats.integrity)]:
        name = "pagewarden:" + e.name + ("_total" if e.kind == "counter" else "")
        assert f"`{name}`" in docs, f"{name} is exported but not in the metrics reference"


def test_batch_limit_changes_are_exported_by_reason() -> None:
    registry = build_registry(_stats, FrontendStatsRecorder().snapshot, "m")
    text = render(registry)[0].decode()
    samples = {
        s.labels["reason"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "pagewarden:batch_limit_changes_total"
    }
    assert samples == {
        "integrity_fault": 0,
        "latency": 3,
        "preemption_storm": 0,
        "recovery": 0,
        "profile": 0,
    }


def test_the_engine_profile_and_its_switches_are_exported() -> None:
    registry = build_registry(_stats, FrontendStatsRecorder().snapshot, "m")
    text = render(registry)[0].decode()
    samples = {
        (s.name, tuple(v for k, v in sorted(s.labels.items()) if k != "model_name")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "profile" in s.name
    }
    assert samples == {
        ("pagewarden:engine_profile", ("normal",)): 0.0,
        ("pagewarden:engine_profile", ("safe",)): 1.0,
        ("pagewarden:profile_switches_total", ("normal", "fault_burst", "safe")): 2.0,
    }
    docs = (_ROOT / "docs" / "metrics.md").read_text()
    assert "`pagewarden:engine_profile{profile}`" in docs
    assert "`pagewarden:profile_switches_total{from,to,reason}`" in docs
