"""``pagewarden chaos``: a mixed workload run fault-free, then with injected faults.

The workload has shared prefixes (prefix-cache hits), ``n > 1`` requests (copy-on-write
forks) and a KV pool small enough to force preemption, to a host (swap) tier too small for
every victim, so requests are both swapped out and recomputed. Both runs are greedy, so every
output of the faulty run must equal the fault-free one when recovery works. Faults are
injected at random steps, kinds taken round robin in random order; the report gives per
kind: injected, detected, recovered, corrupted tokens released (first-order: tokens of a
step that read KV altered by a fault not yet detected), requests failed, the worst
detection delay in steps, and whether the outputs matched.

After the workload the engine's idle scrubber runs until it has re-verified every
sealed block once, so a fault left in a cached block is found even if no request read
it again (that delay is reported too).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from pagewarden.engine.config import DEFAULT_FLIGHT_RECORDER_DIR, EngineConfig
from pagewarden.engine.core import EngineCore
from pagewarden.faults.injector import FAULT_KINDS, FaultInjector, InjectedFault
from pagewarden.kv.block import BlockState
from pagewarden.models.loader import LoadedModel, load_model
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.output import FailureKey


@dataclass(frozen=True)
class KindReport:
    """One row of the chaos table."""

    kind: str
    injected: int
    detected: int
    recovered: int
    harmless: int  # never read again before it became unreachable (overwritten)
    max_delay: int | None  # steps from injection to detection, worst case


@dataclass
class ChaosReport:
    """The outcome of a chaos run."""

    integrity: str
    num_requests: int
    steps_clean: int
    steps_faulty: int
    rows: list[KindReport]
    corrupted_tokens: int
    failed_requests: int
    outputs_equal: bool
    mismatched_requests: list[str] = field(default_factory=list)
    faults: list[InjectedFault] = field(default_factory=list)
    preemptions: int = 0
    swapped_out_blocks: int = 0
    prefix_hit_tokens: int = 0
    invariant_violations: list[str] = field(default_factory=list)
    crash: str | None = None  # the engine raised during the faulty run
    # Blocks still referenced after every request finished: a recovery that freed the
    # wrong block leaks one (the pool is whole when this is 0).
    leaked_blocks: int = 0
    pool_states: dict[str, int] = field(default_factory=dict)  # block state -> count
    flight_records: list[str] = field(default_factory=list)  # files the faulty run wrote

    @property
    def injected(self) -> int:
        return sum(r.injected for r in self.rows)

    @property
    def detected(self) -> int:
        return sum(r.detected for r in self.rows)

    def table(self) -> str:
        """The report as a fixed-width text table."""
        head = (
            f"{'fault kind':<22}{'injected':>9}{'detected':>9}{'recovered':>10}"
            f"{'harmless':>9}{'max delay':>10}"
        )
        lines = [
            f"pagewarden chaos: integrity={self.integrity}, {self.num_requests} requests, "
            f"{self.steps_clean} steps fault-free / {self.steps_faulty} with faults, "
            f"{self.preemptions} preemptions ({self.swapped_out_blocks} blocks swapped "
            f"out), {self.prefix_hit_tokens} prefix-hit tokens",
            head,
            "-" * len(head),
        ]
        for r in self.rows:
            delay = "-" if r.max_delay is None else str(r.max_delay)
            lines.append(
                f"{r.kind:<22}{r.injected:>9}{r.detected:>9}{r.recovered:>10}"
                f"{r.harmless:>9}{delay:>10}"
            )
        lines.append("-" * len(head))
        lines.append(
            f"{'total':<22}{self.injected:>9}{self.detected:>9}"
            f"{sum(r.recovered for r in self.rows):>10}"
            f"{sum(r.harmless for r in self.rows):>9}"
        )
        lines.append(f"corrupted tokens released: {self.corrupted_tokens}")
        lines.append(f"requests failed: {self.failed_requests}")
        lines.append(
            f"outputs identical to the fault-free run: "
            f"{'yes' if self.outputs_equal else 'NO ' + str(self.mismatched_requests)}"
        )
        lines.append(f"metadata invariant violations at the end: {len(self.invariant_violations)}")
        states = ", ".join(f"{n} {state}" for state, n in sorted(self.pool_states.items()))
        lines.append(f"leaked blocks at the end: {self.leaked_blocks} (pool: {states})")
        if self.crash is not None:
            lines.append(f"ENGINE CRASHED during the faulty run: {self.crash}")
        if self.flight_records:
            lines.append(
                f"flight records written ({len(self.flight_records)}; check each with "
                "`pagewarden replay FILE`):"
            )
            lines.extend(f"  {path}" for path in self.flight_records)
        return "\n".join(lines)


def make_workload(
    vocab_size: int, num_requests: int, seed: int = 0, max_tokens: int = 24
) -> list[tuple[list[int], SamplingParams]]:
    """Prompts over three shared prefixes, every fourth request with ``n = 2``."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 4)  # stay clear of special tokens at the start
    prefixes = [
        [rng.randrange(low, vocab_size) for _ in range(rng.randrange(24, 40))] for _ in range(3)
    ]
    workload = []
    for i in range(num_requests):
        tail = [rng.randrange(low, vocab_size) for _ in range(rng.randrange(3, 20))]
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=2 if i % 4 == 3 else 1
        )
        workload.append((prefixes[i % 3] + tail, params))
    return workload


def _run(
    config: EngineConfig,
    loaded: LoadedModel,
    workload,
    injector_seed: int | None,
    num_faults: int,
    fault_steps: list[int],
    kinds: list[str],
):
    engine = EngineCore(config, loaded)
    for i, (ids, params) in enumerate(workload):
        engine.add_request(str(i), ids, params)
    injector = FaultInjector(engine, injector_seed) if injector_seed is not None else None
    plan = list(zip(fault_steps, kinds))
    outputs: dict[str, list[list[int]]] = {}
    failed = 0
    steps = 0
    limit = 50 * (len(workload) + num_faults) + 1000
    crash: str | None = None
    try:
        while engine.has_unfinished():
            while injector is not None and plan and plan[0][0] <= steps:
                _, kind = plan[0]
                if injector.inject(kind) is None:
                    break  # no running request to target yet: try after this step
                plan.pop(0)
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]
                    failed += any(c.finish_reason == "error" for c in out.outputs)
            steps += 1
            if steps > limit:
                raise RuntimeError(f"the run did not finish within {limit} steps")
        if injector is not None:
            scrub_until_covered(engine, injector)
            injector.settle()
    except Exception as exc:  # an undetected fault may break the engine: report it
        if injector is None:
            raise
        crash = f"{type(exc).__name__}: {exc}"
        if engine.recorder is not None:
            engine.recorder.dump(f"engine crash: {crash}")
    if engine.recorder is not None:
        engine.recorder.close()
    return engine, injector, outputs, failed, steps, crash


def scrub_until_covered(engine: EngineCore, injector: FaultInjector) -> None:
    """Idle scrubbing until every sealed block was re-verified once, at the scrubber's
    per-step budget; detections are attributed to the injector's faults."""
    guard = engine.runner.guard
    if not guard.sums_on:
        return
    per_step = max(1, engine.config.scrub_blocks_per_step)
    for _ in range((guard.num_sealed + per_step - 1) // per_step):
        for f in engine.integrity.scrub_idle(per_step):
            injector.mark_detected(set(f.block_ids), FailureKey(f.kind, f.found_by))
        injector.steps += 1


def _tight_pool(workload: list, num_requests: int, max_tokens: int, block_size: int) -> int:
    """Enough KV blocks for about a third of the requests at full length: forces
    preemption."""
    longest = max(len(ids) + max_tokens for ids, _ in workload)
    return max(
        2 + 3 * ((longest + block_size - 1) // block_size),
        num_requests * ((longest + block_size - 1) // block_size) // 3,
    )


def _fault_schedule(seed: int, num_faults: int, steps_clean: int) -> tuple[list[int], list[str]]:
    """The steps (within the first 80% of the fault-free run) and kinds of the faults:
    every kind once per round, in a shuffled order."""
    rng = random.Random(seed + 1)
    fault_steps = sorted(
        rng.randrange(1, max(2, int(steps_clean * 0.8))) for _ in range(num_faults)
    )
    kinds: list[str] = []
    while len(kinds) < num_faults:
        batch = list(FAULT_KINDS)
        rng.shuffle(batch)
        kinds.extend(batch)
    return fault_steps, kinds[:num_faults]


def _kind_rows(injector: FaultInjector, failed: int) -> list[KindReport]:
    """One report row per fault kind: injected, detected, recovered, harmless, delay."""
    rows = []
    for kind in FAULT_KINDS:
        of_kind = [
            f for f in injector.faults if f.kind == kind and f not in injector.pending_faults
        ]
        detected = [f for f in of_kind if f.detected]
        delays = [f.delay for f in detected if f.delay is not None]
        rows.append(
            KindReport(
                kind=kind,
                injected=len(of_kind),
                detected=len(detected),
                recovered=len(detected) if not failed else 0,
                harmless=sum(1 for f in of_kind if not f.detected and not f.live_blocks),
                max_delay=max(delays) if delays else None,
            )
        )
    return rows


def run_chaos(
    model: str | None = None,
    num_faults: int = 20,
    integrity: str = "strict",
    num_requests: int = 16,
    max_tokens: int = 24,
    seed: int = 0,
    dtype: str = "float32",
    num_kv_blocks: int | None = None,
    block_size: int = 8,
    loaded: LoadedModel | None = None,
    num_swap_blocks: int | None = None,
    flight_recorder_steps: int = 256,
    flight_recorder_dir: str = DEFAULT_FLIGHT_RECORDER_DIR,
) -> ChaosReport:
    """Run the workload fault-free and with ``num_faults`` faults; compare and report."""
    if loaded is None:
        loaded = load_model(model, EngineConfig(dtype=dtype).torch_dtype)
    workload = make_workload(loaded.config.vocab_size, num_requests, seed, max_tokens)
    if num_kv_blocks is None:
        num_kv_blocks = _tight_pool(workload, num_requests, max_tokens, block_size)
    if num_swap_blocks is None:
        num_swap_blocks = num_kv_blocks // 2
    config = EngineConfig(
        model=model,
        dtype=dtype,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=256,
        integrity=integrity,
        seed=seed,
        num_swap_blocks=num_swap_blocks,
        flight_recorder_steps=flight_recorder_steps,
        flight_recorder_dir=flight_recorder_dir,
    )
    clean_cfg = dataclasses.replace(config, integrity="off", flight_recorder_steps=0)
    _, _, clean, _, steps_clean, _ = _run(clean_cfg, loaded, workload, None, 0, [], [])
    fault_steps, kinds = _fault_schedule(seed, num_faults, steps_clean)
    engine, injector, faulty, failed, steps_faulty, crash = _run(
        config, loaded, workload, seed + 2, num_faults, fault_steps, kinds
    )
    mismatched = sorted((rid for rid in clean if faulty.get(rid) != clean[rid]), key=int)
    stats = engine.stats()
    rows = _kind_rows(injector, failed)
    pool = engine.scheduler.kv.pool
    counts = pool.state_counts()
    return ChaosReport(
        leaked_blocks=sum(1 for b in pool.blocks[1:] if b.ref_cnt or b.state is BlockState.USED),
        pool_states={state.value: n for state, n in counts.items() if n},
        integrity=integrity,
        num_requests=num_requests,
        steps_clean=steps_clean,
        steps_faulty=steps_faulty,
        rows=rows,
        corrupted_tokens=injector.corrupted_tokens,
        failed_requests=failed,
        outputs_equal=not mismatched and len(faulty) == len(clean),
        mismatched_requests=mismatched,
        faults=list(injector.faults),
        preemptions=stats.num_preemptions,
        swapped_out_blocks=stats.swapped_out_blocks,
        prefix_hit_tokens=stats.prefix_cache_hits,
        invariant_violations=engine.scheduler.check_invariants(),
        crash=crash,
        flight_records=[str(p) for p in engine.recorder.dumps] if engine.recorder else [],
    )
