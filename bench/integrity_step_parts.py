"""What integrity adds to one engine step, part by part, levels alternated in one process.

    python bench/integrity_step_parts.py                         # 1 stream, off/standard/strict
    python bench/integrity_step_parts.py --num-prompts 64 --decode-steps 24

One ``EngineCore`` per level (bf16 weights unless ``--quantization gguf``, prefix caching
off), all in this process so they share the kernel thread pool and the machine's state;
each round runs the same fresh prompts through every level in turn (the order rotating),
timing each all-decode step whole and, inside it, every guard and monitor call and the
forward pass. Prints per level the median decode step, its ratio to ``off``'s median in
the same rounds, and the mean milliseconds per step of each part; note ``uptime`` beside
the figures (a shared machine's load moves them).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the engine's default, before torch loads

from pagewarden.engine.config import EngineConfig  # noqa: E402
from pagewarden.engine.core import EngineCore  # noqa: E402
from pagewarden.sampling_params import SamplingParams  # noqa: E402
from pagewarden.worker import integrity, kv_guard  # noqa: E402

GUARD_PARTS = (
    "check_reads",
    "bind",
    "after_write",
    "_fused_tag_faults",
    "_fused_scrub_faults",
    "_check_slot_mapping",
    "_seal",
    "_seal_written",
    "swap_out",
    "swap_in",
    "copy_blocks",
    "forget",
    "attach_index_readers",
    "_attach_readers",
    "_expected_tags",
    "_scrub_picks",
    "_check_contents",
    "_verify_sealed",
)


#: What parts are timed with: wall time, or with --cpu-time the engine thread's CPU time
#: (time.thread_time: a part preempted by another process on a loaded machine is not
#: charged for the wait; the kernels' worker threads are not counted).
PART_CLOCK = time.perf_counter


class Clock:
    """Wall time per part (nested parts are counted in their parents too)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = collections.defaultdict(float)

    def wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = PART_CLOCK()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[part] += PART_CLOCK() - start

        return timed


class _Current:
    """The clock of the engine being stepped (module functions are wrapped once)."""

    clock: Clock | None = None


def _wrap_module_function(module, name: str, part: str | None = None) -> None:
    """Time ``module.name`` (a module's function or a class's method) as ``part``."""
    fn = getattr(module, name)
    part = part or name

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = PART_CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            if _Current.clock is not None:
                _Current.clock.totals[part] += PART_CLOCK() - start

    setattr(module, name, timed)


def instrument(engine: EngineCore, clock: Clock) -> None:
    guard = engine.runner.guard
    for name in GUARD_PARTS:
        setattr(guard, name, clock.wrap(name, getattr(guard, name)))
    guard.chains.new_tags = clock.wrap("chains.new_tags", guard.chains.new_tags)
    sched = engine.scheduler
    sched.quarantined_block_ids = clock.wrap("quarantined_block_ids", sched.quarantined_block_ids)
    sched.verify_block_tables = clock.wrap("verify_block_tables", sched.verify_block_tables)
    mon = engine.integrity
    mon.audit = clock.wrap("monitor.audit", mon.audit)
    mon.before_schedule = clock.wrap("monitor.before_schedule", mon.before_schedule)
    mon.after_step = clock.wrap("monitor.after_step", mon.after_step)
    model = engine.runner.model
    model.forward = clock.wrap("model forward", model.forward)


def run_level(engine, clock, prompts, output_len, warm=False):
    """Step one batch to the end; the all-decode steps' times and part totals."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    steps: list[float] = []
    _Current.clock = clock
    parts: dict[str, float] = collections.defaultdict(float)
    n_prompt = len(prompts[0])
    while engine.has_unfinished():
        decode = all(r.num_computed_tokens >= n_prompt for r in engine.scheduler.running)
        decode = decode and not engine.scheduler.waiting and bool(engine.scheduler.running)
        clock.totals.clear()
        t0, c0 = time.perf_counter(), time.thread_time()
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        engine.step()
        dt = time.perf_counter() - t0
        if decode:
            r1 = resource.getrusage(resource.RUSAGE_THREAD)
            parts["(step, engine thread CPU)"] += time.thread_time() - c0
            # Count-valued entries (printed per step as they are): the engine thread's
            # context switches, voluntary (it slept or yielded) and not (preempted).
            parts["#voluntary switches"] += (r1.ru_nvcsw - r0.ru_nvcsw) * 1e-3
            parts["#involuntary switches"] += (r1.ru_nivcsw - r0.ru_nivcsw) * 1e-3
            steps.append(dt)
            for k, v in clock.totals.items():
                parts[k] += v
    return steps, parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", choices=("auto", "gguf", "none"))
    ap.add_argument("--levels", default="off,standard,strict")
    ap.add_argument("--num-prompts", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--batch-first",
        type=int,
        default=0,
        help="before each level's timed run, N requests of --input-len/16 (as bench/"
        "throughput.py's batch before its single stream: their blocks stay sealed, freed)",
    )
    ap.add_argument("--cpu-time", action="store_true", help="time parts in thread CPU time")
    args = ap.parse_args()
    if args.cpu_time:
        global PART_CLOCK
        PART_CLOCK = time.thread_time
    levels = args.levels.split(",")
    _wrap_module_function(kv_guard, "allocate_read_checks")
    _wrap_module_function(integrity.SlotChecksums, "store", "slot_checksums")
    engines, clocks = {}, {}
    for level in levels:
        engines[level] = EngineCore(
            EngineConfig(
                model=args.model,
                dtype=args.dtype,
                integrity=level,
                quantization=args.quantization,
                enable_prefix_caching=False,
            )
        )
        clocks[level] = Clock()
        instrument(engines[level], clocks[level])
    vocab = engines[levels[0]].loaded.config.vocab_size
    for level in levels:  # warm-up
        run_level(engines[level], clocks[level], [[100 + i for i in range(16)]] * 2, 4)
    print(f"uptime: {os.popen('uptime').read().strip()}", flush=True)
    med: dict[str, list[float]] = collections.defaultdict(list)
    parts: dict[str, dict[str, float]] = {lv: collections.defaultdict(float) for lv in levels}
    counts = collections.Counter()
    for r in range(args.rounds):
        rng = random.Random(r)
        prompts = [
            [rng.randrange(100, vocab - 100) for _ in range(args.input_len)]
            for _ in range(args.num_prompts)
        ]
        order = levels[r % len(levels) :] + levels[: r % len(levels)]
        line = f"round {r}"
        for level in order:
            if args.batch_first:
                batch = [[100 + (r * 7 + j) % 999 for j in range(args.input_len)]]
                run_level(engines[level], clocks[level], batch * args.batch_first, 16)
            steps, p = run_level(engines[level], clocks[level], prompts, args.decode_steps + 1)
            med[level].append(statistics.median(steps))
            for k, v in p.items():
                parts[level][k] += v
            counts[level] += len(steps)
            line += f"  {level} {med[level][-1] * 1e3:.2f} ms"
        print(line, flush=True)
    print(f"uptime: {os.popen('uptime').read().strip()}")
    base = levels[0]
    print(
        f"\n{args.num_prompts} x {args.input_len}, {args.decode_steps} decode steps, "
        f"{args.rounds} rounds; median decode step, ratio to {base} (median of same-round ratios)"
        f"; parts in {'thread CPU' if args.cpu_time else 'wall'} time"
    )
    for level in levels:
        ratio = statistics.median(b / x for b, x in zip(med[base], med[level]))
        print(f"{level:<10} {statistics.median(med[level]) * 1e3:8.3f} ms   {ratio:.3f}x")
        for k, v in sorted(parts[level].items(), key=lambda kv: -kv[1]):
            print(f"    {k:<26} {v / counts[level] * 1e3:8.3f} ms/step")


if __name__ == "__main__":
    main()
