"""The one module that imports ``prometheus_client``: exports ``pagewarden:*`` metrics.

Every value is read at scrape time from ``EngineStats`` (published by the engine thread)
and ``FrontendStats``, through a custom collector on a private registry per app, so the
numbers in one scrape are consistent with each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagewarden.metrics.stats import FrontendStats, HistogramSnapshot

P = "pagewarden:"


def _gauge(name: str, doc: str, value: float, model: str) -> GaugeMetricFamily:
    g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
    g.add_metric([model], value)
    return g


def _counter(name: str, doc: str, value: float, model: str) -> CounterMetricFamily:
    c = CounterMetricFamily(P + name, doc, labels=["model_name"])
    c.add_metric([model], value)
    return c


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
        yield _gauge("num_requests_running", "Requests in the running batch.", s.num_running, m)
        yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting, m)
        yield _gauge(
            "kv_cache_usage_perc", "Fraction of usable KV blocks in use (0-1).", s.kv_cache_usage, m
        )
        yield _gauge("kv_blocks_free", "Free KV blocks.", s.free_blocks, m)
        yield _gauge("kv_blocks_used", "KV blocks referenced by requests.", s.used_blocks, m)
        yield _gauge(
            "kv_blocks_cached",
            "Free KV blocks still holding prefix-cache entries.",
            s.cached_blocks,
            m,
        )
        yield _gauge(
            "kv_blocks_quarantined", "KV blocks quarantined after a fault.", s.quarantined_blocks, m
        )
        yield _counter("block_allocations", "KV block allocations.", s.block_allocations, m)
        yield _counter("block_frees", "KV block frees.", s.block_frees, m)
        yield _counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
            m,
        )
        yield _counter(
            "prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            s.prefix_cache_hits,
            m,
        )
        yield _counter("num_preemptions", "Requests preempted.", s.num_preemptions, m)
        yield _gauge(
            "num_requests_swapped",
            "Requests whose KV is in the host (swap) tier.",
            s.num_swapped,
            m,
        )
        yield _gauge(
            "kv_host_blocks_free", "Free blocks of the host (swap) tier.", s.free_host_blocks, m
        )
        yield _counter(
            "kv_swapped_out_blocks", "KV blocks copied to the host tier.", s.swapped_out_blocks, m
        )
        yield _counter(
            "kv_swapped_in_blocks",
            "KV blocks copied back from the host tier.",
            s.swapped_in_blocks,
            m,
        )
        yield _counter("prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens, m)
        yield _counter("generation_tokens", "Tokens generated.", s.generation_tokens, m)
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
        success = CounterMetricFamily(
            P + "request_success",
            "Finished requests by reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason in sorted({"stop", "length", "abort", "error", *f.request_success}):
            success.add_metric([m, reason], f.request_success.get(reason, 0))
        yield success
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
        known = {
            "checksum/read",
            "checksum/reuse",
            "checksum/seal",
            "checksum/scrub",
            "checksum/swap_in",
            "slot_tag/read",
            "stale_ref/schedule",
            "table_mismatch/schedule",
        }
        for key in sorted(known | set(i.failures)):
            kind, _, found_by = key.partition("/")
            failures.add_metric([m, kind, found_by], i.failures.get(key, 0))
        failures.add_metric([m, "ownership", "owner_check"], i.ownership_violations)
        failures.add_metric([m, "invariant", "audit"], i.invariant_violations)
        yield failures
        yield _counter(
            "integrity_recoveries", "Faults recovered by rollback and recompute.", i.recoveries, m
        )
        yield _counter(
            "integrity_rolled_back_requests",
            "Requests rolled back by recovery.",
            i.rolled_back_requests,
            m,
        )
        yield _counter(
            "integrity_recomputed_tokens",
            "Computed tokens discarded by recovery.",
            i.recomputed_tokens,
            m,
        )
        yield _counter(
            "integrity_failed_requests",
            "Requests failed by an unrecoverable fault (no healthy blocks).",
            i.failed_requests,
            m,
        )
        yield _counter(
            "kv_blocks_quarantine_events", "Blocks put in quarantine.", i.quarantined_blocks, m
        )
        yield _counter(
            "kv_blocks_quarantine_releases",
            "Quarantined blocks scrubbed, re-verified and returned to service.",
            i.quarantine_releases,
            m,
        )
        yield _gauge(
            "kv_blocks_retired",
            "Blocks retired for good after repeated failures.",
            i.retired_blocks,
            m,
        )


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
