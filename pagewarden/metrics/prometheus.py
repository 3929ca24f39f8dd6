"""The one module that imports ``prometheus_client``: exports ``pagewarden:*`` metrics,
and, when asked, their ``vllm:*`` twins under vLLM's names.

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

from pagewarden.metrics.stats import FrontendStats, HistogramSnapshot, KVTierStats
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


def _cumulative_buckets(h: HistogramSnapshot) -> list[tuple[str, float]]:
    cumulative, buckets = 0, []
    for bound, count in zip((*h.buckets, float("inf")), h.counts):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    return buckets


def _histogram(name: str, doc: str, h: HistogramSnapshot, model: str) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(P + name, doc, labels=["model_name"])
    fam.add_metric([model], _cumulative_buckets(h), sum_value=h.total)
    return fam


class PagewardenCollector:
    """Builds every metric from fresh snapshots on each ``collect()``."""

    def __init__(
        self,
        engine_stats: Callable[[], object],
        frontend_stats: Callable[[], FrontendStats],
        model_name: str,
        vllm_metrics: bool = False,
        vllm_cache_config: dict[str, str] | None = None,
    ) -> None:
        self._engine_stats = engine_stats
        self._frontend_stats = frontend_stats
        self._model = model_name
        self._vllm_metrics = vllm_metrics
        self._vllm_cache_config = vllm_cache_config or {}

    def collect(self) -> Iterator[Metric]:
        s, f, m = self._engine_stats(), self._frontend_stats(), self._model
        yield from _exported(s, m)
        yield _gauge(
            "kv_cache_usage_perc", "Fraction of usable KV blocks in use (0-1).", s.kv_cache_usage, m
        )
        yield from _frontend_metrics(f, m)
        yield _batch_limit_changes(s, m)
        yield from self._profile_metrics(s)
        yield from _latency_histograms(f, m)
        yield from self._integrity_metrics(s)
        if getattr(s, "kv_tiers", None) is not None:
            yield from _kv_tier_metrics(s.kv_tiers, m)
        if self._vllm_metrics:  # from the same snapshots, so each twin pair agrees
            yield from _vllm_twins(s, f, m, self._vllm_cache_config)

    def _profile_metrics(self, s: object) -> Iterator[Metric]:
        """The active engine profile and the switches between profiles (safe mode)."""
        p, m = s.profile, self._model
        active = GaugeMetricFamily(
            P + "engine_profile",
            "Engine profile in force (1 = this).",
            labels=["model_name", "profile"],
        )
        for name in p.profiles:
            active.add_metric([m, name], 1.0 if name == p.active else 0.0)
        yield active
        switches = CounterMetricFamily(
            P + "profile_switches",
            "Engine profile switches, by old and new profile and reason.",
            labels=["model_name", "from", "to", "reason"],
        )
        for (old, new, reason), n in sorted(p.switches.items()):
            switches.add_metric([m, old, new, reason], n)
        yield switches

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


V = "vllm:"
#: vLLM V1 labels every series with the model and the engine index; pagewarden runs one
#: engine per server, index 0.
_VLLM_LABELS = ["model_name", "engine"]


def _frontend_metrics(f: FrontendStats, m: str) -> Iterator[Metric]:
    """The HTTP front end's own counters: admission control, restarts, migrations and
    finished requests by reason."""
    yield _counter(
        "admission_rejections",
        "Requests shed with 429 by admission control.",
        f.admission_rejections,
        m,
    )
    yield _gauge(
        "admission_limit",
        "Generation requests admission control lets in at once (adapts; 0: no gate).",
        f.admission_limit,
        m,
    )
    yield _gauge(
        "admission_in_flight",
        "Generation requests admitted by the gate and not answered yet.",
        f.admission_in_flight,
        m,
    )
    yield _gauge(
        "admission_itl_baseline_seconds",
        "Admission control's unloaded time per token, what it compares admitted streams "
        "with (0: not yet seen).",
        f.admission_itl_baseline_s,
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


def _batch_limit_changes(s, m: str) -> Metric:
    """Changes of the effective batch limits, by reason (every reason, zero or not)."""
    changes = CounterMetricFamily(
        P + "batch_limit_changes",
        "Changes of the effective batch limits by the adaptive batch controller, by reason.",
        labels=["model_name", "reason"],
    )
    for reason in sorted(
        {
            "integrity_fault",
            "latency",
            "preemption_storm",
            "recovery",
            "profile",
            *s.batch_limit_changes,
        }
    ):
        changes.add_metric([m, reason], s.batch_limit_changes.get(reason, 0))
    return changes


def _latency_histograms(f: FrontendStats, m: str) -> Iterator[Metric]:
    """Per-request latency and size histograms, as the front end records them."""
    yield _histogram(
        "time_to_first_token_seconds", "Time to first token.", f.time_to_first_token, m
    )
    yield _histogram(
        "inter_token_latency_seconds", "Time between output tokens.", f.inter_token_latency, m
    )
    yield _histogram("e2e_request_latency_seconds", "Arrival to finish.", f.e2e_request_latency, m)
    yield _histogram(
        "request_queue_time_seconds",
        "Arrival to the start of the step that produced the first token.",
        f.request_queue_time,
        m,
    )
    yield _histogram(
        "request_prompt_tokens",
        "Prompt tokens of each finished request.",
        f.request_prompt_tokens,
        m,
    )
    yield _histogram(
        "request_generation_tokens",
        "Tokens generated for each finished request (all n completions).",
        f.request_generation_tokens,
        m,
    )


def _vllm_twins(s, f: FrontendStats, model: str, cache_config: dict[str, str]) -> Iterator[Metric]:
    """The series that vLLM's consumers (prefix-aware routers, autoscalers, vLLM's Grafana
    dashboards) read, under vLLM's names and labels, with the values of their
    ``pagewarden:*`` twins. Counters are exported with ``_total`` as prometheus_client
    exports vLLM's."""
    values = [model, "0"]
    host_used = (s.host_blocks - s.free_host_blocks) / s.host_blocks if s.host_blocks else 0.0
    for name, doc, value in (
        ("num_requests_running", "Number of requests in model execution batches.", s.num_running),
        ("num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
        ("num_requests_swapped", "Number of requests swapped to CPU.", s.num_swapped),
        ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
        # vLLM's names before 0.10, still read by the Grafana dashboard it shipped.
        (
            "gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage.",
            s.kv_cache_usage,
        ),
        ("cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.", host_used),
    ):
        g = GaugeMetricFamily(V + name, doc, labels=_VLLM_LABELS)
        g.add_metric(values, value)
        yield g
    if cache_config:
        info = GaugeMetricFamily(
            V + "cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=sorted(cache_config),
        )
        info.add_metric([cache_config[k] for k in sorted(cache_config)], 1.0)
        yield info
    for name, doc, value in (
        (
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        ),
        (
            "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        ),
        ("num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions),
        ("prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens),
        ("generation_tokens", "Number of generation tokens processed.", s.generation_tokens),
    ):
        c = CounterMetricFamily(V + name, doc, labels=_VLLM_LABELS)
        c.add_metric(values, value)
        yield c
    yield from _vllm_request_metrics(f, values)


def _vllm_request_metrics(f: FrontendStats, values: list[str]) -> Iterator[Metric]:
    """vLLM's per-request series: finished requests by reason, and the latency and size
    histograms (``values``: the model name and engine index labels)."""
    success = CounterMetricFamily(
        V + "request_success",
        "Count of successfully processed requests.",
        labels=[*_VLLM_LABELS, "finished_reason"],
    )
    for reason in sorted({"stop", "length", "abort", "error", *f.request_success}):
        success.add_metric([*values, reason], f.request_success.get(reason, 0))
    yield success
    for name, doc, h in (
        (
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            f.time_to_first_token,
        ),
        (
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            f.inter_token_latency,
        ),
        # vLLM's older name for the same series, still read by older dashboards.
        (
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            f.inter_token_latency,
        ),
        (
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            f.e2e_request_latency,
        ),
        (
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            f.request_queue_time,
        ),
        (
            "request_prompt_tokens",
            "Number of prefill tokens processed.",
            f.request_prompt_tokens,
        ),
        (
            "request_generation_tokens",
            "Number of generation tokens processed.",
            f.request_generation_tokens,
        ),
    ):
        fam = HistogramMetricFamily(V + name, doc, labels=_VLLM_LABELS)
        fam.add_metric(values, _cumulative_buckets(h), sum_value=h.total)
        yield fam


def _kv_tier_metrics(t: KVTierStats, m: str) -> Iterator[Metric]:
    """Hits, stores, rejections by reason, errors, bytes and load latency of the KV tiers."""
    per_tier = (
        ("kv_tier_hits", "Blocks loaded (verified) from a KV tier.", t.hits, CounterMetricFamily),
        ("kv_tier_stores", "Blocks written to a KV tier.", t.stores, CounterMetricFamily),
        (
            "kv_tier_errors",
            "KV tier calls that failed or timed out (misses).",
            t.errors,
            CounterMetricFamily,
        ),
        (
            "kv_tier_bytes",
            "Bytes a KV tier holds (as far as this engine knows).",
            t.bytes,
            GaugeMetricFamily,
        ),
    )
    for name, doc, values, family in per_tier:
        fam = family(P + name, doc, labels=["model_name", "tier"])
        for tier, value in sorted(values.items()):
            fam.add_metric([m, tier], value)
        yield fam
    rejected = CounterMetricFamily(
        P + "kv_tier_rejected",
        "KV tier entries that failed verification (a miss; the entry is deleted), by reason.",
        labels=["model_name", "tier", "reason"],
    )
    for (tier, reason), n in sorted(t.rejected.items()):
        rejected.add_metric([m, tier, reason], n)
    yield rejected
    yield _counter(
        "kv_tier_offload_dropped",
        "Evicted blocks not offloaded because the tier writer's queue was full.",
        t.offload_dropped,
        m,
    )
    yield _counter(
        "kv_tier_load_timeouts",
        "KV tier loads given up because no block landed within the load timeout "
        "(a hung tier); the request computes the blocks not loaded.",
        t.load_timeouts,
        m,
    )
    yield _histogram(
        "kv_tier_load_seconds",
        "Time to fetch and verify one block from a KV tier.",
        t.load_latency,
        m,
    )


def build_registry(
    engine_stats: Callable[[], object],
    frontend_stats: Callable[[], FrontendStats],
    model_name: str,
    vllm_metrics: bool = False,
    vllm_cache_config: dict[str, str] | None = None,
) -> CollectorRegistry:
    """A private registry holding only pagewarden's collector; ``vllm_metrics`` adds the
    ``vllm:*`` twins, ``vllm_cache_config`` the labels of ``vllm:cache_config_info``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        PagewardenCollector(
            engine_stats, frontend_stats, model_name, vllm_metrics, vllm_cache_config
        )
    )
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The text exposition and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
