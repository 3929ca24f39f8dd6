"""``pagewarden chaos --scenario storm``: a burst of faults on a busy engine, then calm.

The scenario of issue 17: a workload keeps the batch full (new requests arrive as others
finish) while, after a calm start, ``num_faults`` faults arrive over ``burst_s`` seconds
and then stop. What the engine must do by itself, and what the report checks:

    calm        batch at the configured max_num_seqs, profile normal
    burst       each detected fault halves the batch limit (adaptive batch controller);
                K faults within W seconds switch the profile to safe (integrity strict,
                batch held at the floor, no swapping, faster scrubber)
    calm again  after the clean period the profile returns to normal and the batch limit
                climbs back from the floor, one clean window at a time
    drain       no new requests; the idle scrubber re-verifies every sealed block once

Every fault must be detected (or become unreadable before anyone read it: ``harmless``),
no request may fail, and every output must equal the fault-free run's (greedy, float32:
recomputed KV is bit-identical). The per-step samples feed the plot (``storm_plot.py``).
Only kinds that alter or misdirect KV are injected (a refused foreign-thread call
changes nothing to recover from; host-tier faults need swapping, which safe mode stops).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from pagewarden.chaos.campaign import make_workload, scrub_until_covered
from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core import EngineCore
from pagewarden.faults.injector import FaultInjector
from pagewarden.models.loader import LoadedModel, load_model

STORM_KINDS: tuple[str, ...] = (
    "index_redirect",
    "sealed_bitflip",
    "table_redirect",
    "slot_mapping_redirect",
    "use_after_free",
    "slot_redirect",
    "tag_corruption",
    "coherent_wrong_ref",
)


@dataclass(frozen=True)
class StormSample:
    """The engine after one step."""

    t: float  # seconds since the scenario started
    running: int  # requests in the running batch
    max_num_seqs: int  # the effective limit
    profile: str
    injected: int  # faults injected before this step
    detected: int  # faults recovered in this step


@dataclass(frozen=True)
class StormEvent:
    t: float
    text: str


@dataclass
class StormReport:
    """The outcome of a storm run, with the facts the scenario checks."""

    model: str
    config: EngineConfig
    floor: int
    burst: tuple[float, float]  # first and last injection, seconds
    samples: list[StormSample]
    events: list[StormEvent]
    injected: int
    detected: int
    harmless: int
    recoveries: int
    failed_requests: int
    num_requests: int
    outputs_equal: bool
    mismatched_requests: list[str]
    switches: dict[tuple[str, str, str], int]
    # None: this build has no flight recorder (issue 17 item 3); else the files it wrote.
    flight_recorder_files: list[str] | None = None
    plot: str | None = None
    elapsed_s: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)

    @property
    def limit_fell(self) -> bool:
        return min(s.max_num_seqs for s in self.samples) < self.config.max_num_seqs

    @property
    def limit_recovered(self) -> bool:
        return self.limit_fell and self.samples[-1].max_num_seqs == self.config.max_num_seqs

    @property
    def went_safe(self) -> bool:
        return any(new == "safe" for _, new, _ in self.switches)

    @property
    def came_back(self) -> bool:
        return self.went_safe and self.samples[-1].profile == self.config.profile

    @property
    def all_recovered(self) -> bool:
        """Every fault found (or unreadable before anyone read it) and no request failed:
        each detection was followed by a recovery that cost the user nothing."""
        return self.detected + self.harmless == self.injected and self.failed_requests == 0

    def table(self) -> str:
        c = self.config
        yes = {True: "yes", False: "NO"}
        lines = [
            f"pagewarden chaos --scenario storm: model {self.model}, integrity {c.integrity}, "
            f"max_num_seqs {c.max_num_seqs} (floor {self.floor}); safe mode after "
            f"{c.safe_mode_faults} faults within {c.safe_mode_window:g} s, back after "
            f"{c.safe_mode_clean_period:g} s clean",
            f"{self.num_requests} requests over {self.elapsed_s:.1f} s, "
            f"{len(self.samples)} steps; {self.injected} faults injected from "
            f"{self.burst[0]:.1f} s to {self.burst[1]:.1f} s (at most one per step)",
            "timeline:",
            *(f"  {e.t:7.2f} s  {e.text}" for e in self.events),
            f"faults: {self.injected} injected, {self.detected} detected, {self.harmless} "
            f"harmless (unreadable before any read), {self.recoveries} recoveries (a fault "
            f"can take more than one; faults one check found together share one), "
            f"{self.failed_requests} requests failed; by kind: "
            + ", ".join(f"{k} {n}" for k, n in self.kinds.items()),
            f"batch limit fell: {yes[self.limit_fell]} (min "
            f"{min(s.max_num_seqs for s in self.samples)}), recovered to {c.max_num_seqs}: "
            f"{yes[self.limit_recovered]}",
            f"profile switched to safe: {yes[self.went_safe]}, came back to {c.profile}: "
            f"{yes[self.came_back]}",
            f"every fault detected and recovered: {yes[self.all_recovered]}",
            "outputs identical to the fault-free run: "
            + (yes[True] if self.outputs_equal else "NO " + str(self.mismatched_requests)),
        ]
        if self.flight_recorder_files is None:
            lines.append("flight recorder: not in this build")
        else:
            lines.append(
                f"flight recorder: {len(self.flight_recorder_files)} file(s)"
                + "".join(f"\n  {p}" for p in self.flight_recorder_files)
            )
        if self.plot is not None:
            lines.append(f"plot: {self.plot}")
        return "\n".join(lines)


def with_flight_recorder(config: EngineConfig, directory: Path) -> EngineConfig | None:
    """``config`` with its flight recorder writing to ``directory``; None when this build
    has no flight recorder.

    The one place the storm connects to the flight recorder (issue 17 item 3): it
    configures it through the engine argument ``flight_recorder_dir`` and the report
    lists the files found in that directory after the run.
    """
    if "flight_recorder_dir" not in {f.name for f in fields(EngineConfig)}:
        return None
    return dataclasses.replace(config, flight_recorder_dir=str(directory))  # type: ignore[call-arg]


def storm_config(model: str | None, **overrides) -> EngineConfig:
    """The engine the storm runs: standard integrity (safe makes it strict), a host tier
    (safe stops swapping), a latency target out of reach (only faults move the batch)."""
    kw = dict(
        model=model,
        dtype="float32",
        block_size=8,
        num_kv_blocks=320,
        num_swap_blocks=64,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        integrity="standard",
        target_itl_ms=60_000.0,
        safe_mode_faults=3,
        safe_mode_window=5.0,
        safe_mode_clean_period=2.0,
    )
    kw.update(overrides)
    return EngineConfig(**kw)


def run_storm(
    config: EngineConfig,
    loaded: LoadedModel | None = None,
    num_faults: int = 12,
    warmup_s: float = 1.0,
    burst_s: float = 3.0,
    max_s: float = 300.0,
    max_tokens: int = 24,
    seed: int = 0,
    recorder_dir: Path | None = None,
) -> StormReport:
    """Run the storm and its fault-free reference; compare and report."""
    if loaded is None:
        loaded = load_model(config.model, config.torch_dtype, config.resolved_quantization)
    recorded = with_flight_recorder(config, recorder_dir) if recorder_dir is not None else None
    run = _StormRun(recorded or config, loaded, seed, max_tokens)
    start = time.monotonic()
    run.drive(num_faults, warmup_s, burst_s, max_s)
    elapsed = time.monotonic() - start
    clean = _reference(config, loaded, run.submitted)
    mismatched = sorted((r for r in clean if run.outputs.get(r) != clean[r]), key=int)
    injector = run.injector
    detected = [f for f in injector.faults if f.detected]
    stats = run.engine.stats()
    files = None
    if recorded is not None and recorder_dir is not None:
        files = sorted(str(p) for p in recorder_dir.iterdir())
    kinds: dict[str, int] = {}
    for f in injector.faults:
        kinds[f.kind] = kinds.get(f.kind, 0) + 1
    return StormReport(
        model=loaded.name,
        config=config,
        floor=run.engine.safe_mode.settings["safe"].max_num_seqs,
        burst=run.burst,
        samples=run.samples,
        events=run.events,
        injected=len(injector.faults),
        detected=len(detected),
        harmless=sum(1 for f in injector.faults if not f.detected and not f.live_blocks),
        recoveries=stats.integrity.recoveries,
        failed_requests=run.failed,
        num_requests=len(run.submitted),
        outputs_equal=not mismatched and len(run.outputs) == len(clean),
        mismatched_requests=mismatched,
        switches=dict(stats.profile.switches),
        flight_recorder_files=files,
        elapsed_s=elapsed,
        kinds=kinds,
    )


class _StormRun:
    """The faulty run: an open-loop workload, a timed burst, per-step samples."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, seed: int, max_tokens: int):
        self.config = config
        self.engine = EngineCore(config, loaded)
        self.injector = FaultInjector(self.engine, seed + 2)
        self.workload = make_workload(loaded.config.vocab_size, 4000, seed, max_tokens)
        self.submitted: list = []
        self.outputs: dict[str, list[list[int]]] = {}
        self.failed = 0
        self.samples: list[StormSample] = []
        self.events: list[StormEvent] = []
        self.burst = (0.0, 0.0)

    def drive(self, num_faults: int, warmup_s: float, burst_s: float, max_s: float) -> None:
        engine, cfg = self.engine, self.config
        times = [warmup_s + burst_s * i / max(1, num_faults - 1) for i in range(num_faults)]
        kinds = [STORM_KINDS[i % len(STORM_KINDS)] for i in range(num_faults)]
        t0: float | None = None  # the clock starts once the first step (prefill) is done
        adding, settled_at = True, None
        last = (cfg.max_num_seqs, cfg.profile)
        while adding or engine.has_unfinished():
            t = 0.0 if t0 is None else time.monotonic() - t0
            in_flight = len(self.submitted) - len(self.outputs)
            while adding and in_flight < 2 * cfg.max_num_seqs:
                ids, params = self.workload[len(self.submitted)]
                engine.add_request(str(len(self.submitted)), ids, params)
                self.submitted.append((ids, params))
                in_flight += 1
            # At most one fault per step: on a slow model the burst stretches over steps.
            due = t0 is not None and bool(times) and times[0] <= t
            if due and self.injector.inject(kinds[0]) is not None:
                if len(times) == num_faults:
                    self._event(t, f"fault burst starts ({num_faults} faults over {burst_s:g} s)")
                    self.burst = (t, t)
                self.burst = (self.burst[0], t)
                times.pop(0)
                kinds.pop(0)
            recoveries = engine.integrity.recoveries
            for out in engine.step():
                if out.finished:
                    self.outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]
                    self.failed += any(c.finish_reason == "error" for c in out.outputs)
            t0 = time.monotonic() if t0 is None else t0
            t = time.monotonic() - t0
            now = (engine.scheduler.max_num_seqs, engine.safe_mode.controller.active)
            self._sample(t, now, engine.integrity.recoveries - recoveries, num_faults - len(times))
            if now != last:
                self._changed(t, last, now)
                last = now
            if times or now != (cfg.max_num_seqs, cfg.profile):
                settled_at = None
            elif settled_at is None:
                settled_at = t
            elif t - settled_at >= 0.5:  # a little steady state after the recovery
                adding = False
            if t > max_s:
                adding = False
        scrub_until_covered(engine, self.injector)
        self.injector.settle()

    def _sample(self, t: float, now: tuple[int, str], detected: int, injected: int) -> None:
        self.samples.append(
            StormSample(t, len(self.engine.scheduler.running), now[0], now[1], injected, detected)
        )

    def _changed(self, t: float, last: tuple[int, str], now: tuple[int, str]) -> None:
        if now[1] != last[1]:
            state = self.engine.safe_mode.controller
            self._event(t, f"profile {last[1]} -> {now[1]} ({state.reason}: {state.detail})")
        if now[0] != last[0]:
            self._event(t, f"batch limit {last[0]} -> {now[0]}")

    def _event(self, t: float, text: str) -> None:
        self.events.append(StormEvent(t, text))


def _reference(config: EngineConfig, loaded: LoadedModel, workload) -> dict[str, list[list[int]]]:
    """The same requests, fault-free, all at once."""
    engine = EngineCore(dataclasses.replace(config, auto_safe_mode=False), loaded)
    for i, (ids, params) in enumerate(workload):
        engine.add_request(str(i), ids, params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]
    return outputs
