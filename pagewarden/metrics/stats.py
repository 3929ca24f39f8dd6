"""Front-end statistics as plain dataclasses (no prometheus here; see ``prometheus.py``).

The async engine records request latencies and outcomes into a ``FrontendStatsRecorder``;
the exporter reads ``snapshot()`` at scrape time, so a scrape is always self-consistent.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

#: Latency buckets in seconds (vLLM-like spread, from sub-millisecond to minutes).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)


#: Token-count buckets (1-2-5 steps, as vLLM's request token histograms).
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))


@dataclass(frozen=True)
class HistogramSnapshot:
    """Per-bucket (non-cumulative) counts; ``counts[-1]`` is the +Inf overflow bucket."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    total: float
    count: int


@dataclass
class Histogram:
    """A fixed-bucket histogram; not thread-safe on its own (the recorder locks)."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.buckets, tuple(self.counts), self.total, self.count)


@dataclass(frozen=True)
class FrontendStats:
    """A snapshot of what the async front end measured."""

    admission_rejections: int
    request_success: dict[str, int]  # finish reason -> finished requests
    time_to_first_token: HistogramSnapshot
    inter_token_latency: HistogramSnapshot
    e2e_request_latency: HistogramSnapshot
    request_queue_time: HistogramSnapshot
    engine_restarts: int = 0  # engine-core processes restarted by the supervisor
    # Per finished request: prompt tokens, and tokens generated (all n completions).
    request_prompt_tokens: HistogramSnapshot = field(
        default_factory=lambda: Histogram(TOKEN_BUCKETS).snapshot()
    )
    request_generation_tokens: HistogramSnapshot = field(
        default_factory=lambda: Histogram(TOKEN_BUCKETS).snapshot()
    )
    request_migrations: int = 0  # requests re-submitted after their replica died (serve/)
    admission_limit: int = 0  # the admission gate's current in-flight limit (0: no gate)
    admission_in_flight: int = 0  # generation requests the gate admitted, not yet answered
    # The gate's unloaded time per token (its inter-token latency baseline; 0: not yet seen).
    admission_itl_baseline_s: float = 0.0


class FrontendStatsRecorder:
    """Thread-safe accumulation of front-end counters and latency histograms."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._admission_rejections = 0
        self._success: dict[str, int] = {}
        self._ttft = Histogram()
        self._itl = Histogram()
        self._e2e = Histogram()
        self._queue = Histogram()
        self._prompt_tokens = Histogram(TOKEN_BUCKETS)
        self._generation_tokens = Histogram(TOKEN_BUCKETS)

    def admission_rejected(self) -> None:
        with self._lock:
            self._admission_rejections += 1

    def first_token(self, ttft: float, queue_time: float) -> None:
        with self._lock:
            self._ttft.observe(ttft)
            self._queue.observe(queue_time)

    def inter_token(self, seconds: float) -> None:
        with self._lock:
            self._itl.observe(seconds)

    def finished(
        self,
        reason: str,
        e2e: float,
        prompt_tokens: int | None = None,
        generation_tokens: int | None = None,
    ) -> None:
        """A request finished; its token counts are recorded when given."""
        with self._lock:
            self._success[reason] = self._success.get(reason, 0) + 1
            self._e2e.observe(e2e)
            if prompt_tokens is not None:
                self._prompt_tokens.observe(prompt_tokens)
            if generation_tokens is not None:
                self._generation_tokens.observe(generation_tokens)

    def snapshot(
        self,
        engine_restarts: int = 0,
        gate_rejections: int = 0,
        request_migrations: int = 0,
        admission_limit: int = 0,
        admission_in_flight: int = 0,
        admission_itl_baseline_s: float = 0.0,
    ) -> FrontendStats:
        """``gate_rejections``: 429s the server's admission gate sent before parsing."""
        with self._lock:
            return FrontendStats(
                admission_rejections=self._admission_rejections + gate_rejections,
                request_success=dict(self._success),
                time_to_first_token=self._ttft.snapshot(),
                inter_token_latency=self._itl.snapshot(),
                e2e_request_latency=self._e2e.snapshot(),
                request_queue_time=self._queue.snapshot(),
                engine_restarts=engine_restarts,
                request_prompt_tokens=self._prompt_tokens.snapshot(),
                request_generation_tokens=self._generation_tokens.snapshot(),
                request_migrations=request_migrations,
                admission_limit=admission_limit,
                admission_in_flight=admission_in_flight,
                admission_itl_baseline_s=admission_itl_baseline_s,
            )


@dataclass(frozen=True)
class KVTierStats:
    """The KV tiers' counters (kvstore/store.py), per tier name; monotonic but ``bytes``."""

    hits: dict[str, int]  # blocks loaded (verified) from the tier
    stores: dict[str, int]  # blocks written to the tier
    rejected: dict[tuple[str, str], int]  # (tier, reason) -> entries that failed a check
    errors: dict[str, int]  # calls that failed or timed out
    bytes: dict[str, int]  # bytes the tier holds (as far as this engine knows)
    misses: int
    offload_dropped: int  # evicted blocks not offloaded: the writer's queue was full
    offload_unverified: int  # evicted blocks not offloaded: their bytes failed their seal
    load_latency: HistogramSnapshot  # seconds per verified block load
    load_timeouts: int = 0  # request loads given up: no progress within the load timeout
