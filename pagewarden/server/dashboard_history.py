"""The dashboard's time series: one sample a second of the stats the server already has.

A sampler thread in the HTTP process reads the ``EngineStats`` the engine core sent with
its latest step or heartbeat and the front end's ``FrontendStats`` (both already in this
process: sampling costs the engine nothing) and keeps the last ``HISTORY_S`` seconds.
Counters become rates averaged over ``RATE_WINDOW`` seconds (events such as recoveries
stay counts per interval); latency percentiles come from the histogram counts added over
the last ``PERCENTILE_WINDOW`` samples.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagewarden.metrics.stats import FrontendStats, HistogramSnapshot

#: Seconds of history kept (one sample a second).
HISTORY_S = 300
SAMPLE_INTERVAL_S = 1.0
#: Latency percentiles are taken over this many seconds of observations.
PERCENTILE_WINDOW = 10
#: Rates (tokens/s, checks/s, 429s/s) are averaged over this many seconds.
RATE_WINDOW = 5


@dataclass(frozen=True)
class Sample:
    """One point of every series; rates (``*_tps``, ``*_ps``) are per second over the
    ``RATE_WINDOW`` seconds before ``t``, counts are for the interval before ``t``."""

    t: float  # wall clock
    kv_usage: float  # used / usable blocks
    running: int
    waiting: int
    swapped: int
    generation_tps: float
    prompt_tps: float
    ttft_p50_ms: float | None  # None: no first token in the window
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    admission_rejections_ps: float
    tag_checks_ps: float
    block_verifies_ps: float
    recoveries: int  # in the interval
    preemptions: int  # in the interval
    max_num_seqs: int  # the effective (adaptive) batch limit
    profile: str
    failures: dict[str, int] = field(default_factory=dict)  # "kind/found_by" -> in interval


def percentile(new: HistogramSnapshot, old: HistogramSnapshot | None, q: float) -> float | None:
    """The ``q`` quantile (0..1) of the observations ``new`` has beyond ``old``, linear
    inside the bucket it falls in; None when there are none."""
    counts = [n - (old.counts[i] if old else 0) for i, n in enumerate(new.counts)]
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            lo = new.buckets[i - 1] if i > 0 else 0.0
            hi = new.buckets[i] if i < len(new.buckets) else new.buckets[-1]
            return lo + (hi - lo) * (rank - seen) / n
        seen += n
    return new.buckets[-1]


def profile_name(stats) -> str:
    """The engine profile the stats carry ("normal" where the engine has none)."""
    profile = getattr(stats, "profile", None)
    if profile is None:
        return "normal"
    return str(getattr(profile, "active", profile))


def _checks(stats) -> tuple[int, int]:
    integrity = stats.integrity
    return integrity.tag_checks, integrity.block_verifies + integrity.slot_verifies


class DashboardHistory:
    """The last ``HISTORY_S`` seconds of samples; ``sample()`` from one thread at a time."""

    def __init__(self) -> None:
        self.samples: deque[Sample] = deque(maxlen=int(HISTORY_S / SAMPLE_INTERVAL_S))
        # (monotonic time, EngineStats, FrontendStats) of the last few samples.
        self._raw: deque[tuple[float, object, FrontendStats]] = deque(maxlen=PERCENTILE_WINDOW + 1)
        self._lock = threading.Lock()

    def sample(self, engine_stats, frontend: FrontendStats, now: float | None = None) -> None:
        """Add one point from the current stats (skipped until the engine sent any)."""
        if engine_stats is None:
            return
        mono = time.monotonic() if now is None else now
        raw = self._raw
        s, f = engine_stats, frontend
        # Counts per interval against the previous sample; rates over the last
        # RATE_WINDOW samples (a step can take longer than one interval); percentiles
        # over all PERCENTILE_WINDOW kept.
        _, ps, _ = raw[-1] if raw else (mono, s, f)
        t0, rs, rf = raw[-min(len(raw), RATE_WINDOW)] if raw else (mono, s, f)
        old_f = raw[0][2] if raw else None
        raw.append((mono, s, f))
        dt = mono - t0
        # max(0, ...): a restarted engine core counts from zero again.
        rate = (lambda a, b: max(a - b, 0) / dt) if dt > 0 else (lambda a, b: 0.0)

        def ms(h: str, q: float) -> float | None:
            v = percentile(getattr(f, h), getattr(old_f, h) if old_f else None, q)
            return None if v is None else v * 1e3

        tags, verifies = _checks(s)
        rtags, rverifies = _checks(rs)
        point = Sample(
            t=time.time(),
            kv_usage=s.kv_cache_usage,
            running=s.num_running,
            waiting=s.num_waiting,
            swapped=s.num_swapped,
            generation_tps=rate(s.generation_tokens, rs.generation_tokens),
            prompt_tps=rate(s.prompt_tokens, rs.prompt_tokens),
            ttft_p50_ms=ms("time_to_first_token", 0.5),
            ttft_p99_ms=ms("time_to_first_token", 0.99),
            itl_p50_ms=ms("inter_token_latency", 0.5),
            itl_p99_ms=ms("inter_token_latency", 0.99),
            admission_rejections_ps=rate(f.admission_rejections, rf.admission_rejections),
            tag_checks_ps=rate(tags, rtags),
            block_verifies_ps=rate(verifies, rverifies),
            recoveries=max(s.integrity.recoveries - ps.integrity.recoveries, 0),
            preemptions=max(s.num_preemptions - ps.num_preemptions, 0),
            max_num_seqs=s.effective_max_num_seqs,
            profile=profile_name(s),
            failures={
                f"{k.kind}/{k.found_by}": max(n - ps.integrity.failures.get(k, 0), 0)
                for k, n in s.integrity.failures.items()
            },
        )
        with self._lock:
            self.samples.append(point)

    def series(self) -> dict[str, list]:
        """Every series as a column (``t`` first); ``failures`` maps each kind seen in
        the window to its column (0 where it had not been seen yet)."""
        with self._lock:
            samples = list(self.samples)
        names = [n for n in Sample.__dataclass_fields__ if n != "failures"]
        out: dict[str, list] = {n: [getattr(p, n) for p in samples] for n in names}
        kinds = sorted({k for p in samples for k in p.failures})
        out["failures"] = {k: [p.failures.get(k, 0) for p in samples] for k in kinds}  # type: ignore[assignment]
        return out


class HistorySampler:
    """A daemon thread calling ``history.sample(*read())`` every ``SAMPLE_INTERVAL_S``."""

    def __init__(self, history: DashboardHistory, read: Callable[[], tuple]) -> None:
        self.history, self.read = history, read
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="pagewarden-dashboard-history", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self.history.sample(*self.read())

    def stop(self) -> None:
        self._stop.set()
