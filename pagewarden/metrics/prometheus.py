"""The one module that imports ``prometheus_client``: exports ``pagewarden:*`` metrics.

Every value is read at scrape time from ``EngineStats`` (published by the engine thread)
and ``FrontendStats``, through a custom collector on a private registry per app, so the
numbers in one scrape are consistent with each other. Plain gauges and counters come
from the stats fields declared with ``sched.stats.metric`` (name, kind and help text
live there); the labelled families are built here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import get_args

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagewarden.metrics.stats import FrontendStats, HistogramSnapshot
from pagewarden.sched.output import FailureKey, Finder, TableFaultKind
from pagewarden.sched.stats import exported_fields

P = "pagewarden:"


def _gauge(name: str, doc: str, value: float, model: str) -> GaugeMetricFamily:
    g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
    g.add_metric([model], value)
    return g


def _counter(name: str, doc: str, value: float, model: str) -> CounterMetricFamily:
    c = CounterMetricFamily(P + name, doc, labels=["model_name"])
    c.add_metric([model], value)
    return c


def _exported(stats: object, model: str) -> Iterator[Metric]:
    """The fields of a stats snapshot declared with ``sched.stats.metric``."""
    for e in exported_fields(stats):
        make = _gauge if e.kind == "gauge" else _counter
        yield make(e.name, e.doc, e.value, model)


def _histogram(name: str, doc: str, h: HistogramSnapshot, model: str) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(P + name, doc, labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, count in zip((*h.buckets, float("inf")), h.counts):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    fam.add_metric([model], buckets, sum_value=h.total)
    return fam


class PagewardenCollector:
    """Builds every metric from fresh snapshots on each ``collect()``."""

    def __init__(
        self,
        engine_stats: Callable[[], object],
        frontend_stats: Callable[[], FrontendStats],
        model_name: str,
    ) -> None:
        self._engine_stats = engine_stats
        self._frontend_stats = frontend_stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        s, f, m = self._engine_stats(), self._frontend_stats(), self._model
        yield from _exported(s, m)
        yield _gauge(
            "kv_cache_usage_perc", "Fraction of usable KV blocks in use (0-1).", s.kv_cache_usage, m
        )
        yield _counter(
            "admission_rejections",
            "Requests shed with 429 by admission control.",
            f.admission_rejections,
            m,
        )
        yield _counter(
            "engine_restarts",
            "Engine-core processes restarted after a crash or a stall.",
            f.engine_restarts,
            m,
        )
        yield _counter(
            "request_migrations",
            "Requests re-submitted to another Ray Serve replica after theirs died.",
            f.request_migrations,
            m,
        )
        success = CounterMetricFamily(
            P + "request_success",
            "Finished requests by reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason in sorted({"stop", "length", "abort", "error", *f.request_success}):
            success.add_metric([m, reason], f.request_success.get(reason, 0))
        yield success
        changes = CounterMetricFamily(
            P + "batch_limit_changes",
            "Changes of the effective batch limits by the adaptive batch controller, by reason.",
            labels=["model_name", "reason"],
        )
        for reason in sorted(
            {"integrity_fault", "latency", "preemption_storm", "recovery", *s.batch_limit_changes}
        ):
            changes.add_metric([m, reason], s.batch_limit_changes.get(reason, 0))
        yield changes
        yield _histogram(
            "time_to_first_token_seconds", "Time to first token.", f.time_to_first_token, m
        )
        yield _histogram(
            "inter_token_latency_seconds", "Time between output tokens.", f.inter_token_latency, m
        )
        yield _histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", f.e2e_request_latency, m
        )
        yield _histogram(
            "request_queue_time_seconds",
            "Arrival to the start of the step that produced the first token.",
            f.request_queue_time,
            m,
        )
        yield from self._integrity_metrics(s)

    def _integrity_metrics(self, s: object) -> Iterator[Metric]:
        """Integrity checks and failures by kind, recoveries, quarantine, audits."""
        i, m = s.integrity, self._model
        level = GaugeMetricFamily(
            P + "integrity_level",
            "Integrity level in force (1 = this).",
            labels=["model_name", "level"],
        )
        for name in ("off", "audit", "standard", "strict"):
            level.add_metric([m, name], 1.0 if i.level == name else 0.0)
        yield level
        checks = CounterMetricFamily(
            P + "integrity_checks", "Integrity checks run, by kind.", labels=["model_name", "kind"]
        )
        for kind, value in (
            ("slot_tag", i.tag_checks),
            ("block_checksum", i.block_verifies),
            ("slot_checksum", i.slot_verifies),
            ("scrub", i.scrubbed_blocks),
            ("audit", i.audits),
        ):
            checks.add_metric([m, kind], value)
        yield checks
        failures = CounterMetricFamily(
            P + "integrity_failures",
            "Integrity checks that failed, by kind and finder.",
            labels=["model_name", "kind", "found_by"],
        )
        known = [
            FailureKey(kind, found_by)
            for kind, finders in (
                ("checksum", get_args(Finder)),
                ("slot_tag", ("read",)),
                *((kind, ("schedule",)) for kind in get_args(TableFaultKind)),
            )
            for found_by in finders
        ]
        for key in sorted({*known, *i.failures}):
            failures.add_metric([m, key.kind, key.found_by], i.failures.get(key, 0))
        failures.add_metric([m, "ownership", "owner_check"], i.ownership_violations)
        failures.add_metric([m, "invariant", "audit"], i.invariant_violations)
        yield failures
        yield from _exported(i, m)


def build_registry(
    engine_stats: Callable[[], object], frontend_stats: Callable[[], FrontendStats], model_name: str
) -> CollectorRegistry:
    """A private registry holding only pagewarden's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PagewardenCollector(engine_stats, frontend_stats, model_name))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The text exposition and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
