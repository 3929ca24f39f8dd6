"""Scheduler + engine bookkeeping as a fraction of the model step, on a real engine.

    python bench/bookkeeping.py [--batch 32 256] [--output-len 24] [--dtype bfloat16]

For each batch size, ``batch`` requests (random 32-token prompts, greedy, ``ignore_eos``)
run to completion on the default model. Every ``EngineCore.step`` is split into the
runner's share (``runner.execute``: swaps, integrity checks, forward pass, sampling) and
the rest, the bookkeeping: applying queued requests, ``scheduler.schedule``,
``scheduler.update``, the integrity monitor and the output processor (detokenising).
Prints per-part medians over the decode steps (every request running, none prefilling)
and bookkeeping / runner as a percentage. The target is under 1% at batch 32 and 256.

Works against any checkout (``PAGEWARDEN_ROOT=/path/to/checkout``): it times the parts
by wrapping the engine's objects from outside, not through hooks in the code.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.environ.get("PAGEWARDEN_ROOT") or str(Path(__file__).resolve().parents[1]))

from pagewarden import LLM, SamplingParams  # noqa: E402

_PARTS = ("schedule", "execute", "update", "outputs")


class _Timer:
    """Accumulates the seconds spent in wrapped callables during one step."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(_PARTS, 0.0)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - start

        return timed


def measure(llm: LLM, batch: int, prompt_len: int, output_len: int) -> dict[str, float]:
    """Median seconds per decode step of each part, the step, and the bookkeeping."""
    engine = llm.engine
    timer = _Timer()
    sched, runner, outputs = engine.scheduler, engine.runner, engine.outputs
    sched.schedule = timer.wrap("schedule", sched.schedule)
    sched.update = timer.wrap("update", sched.update)
    runner.execute = timer.wrap("execute", runner.execute)
    outputs.process = timer.wrap("outputs", outputs.process)
    rng = random.Random(batch)
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}", prompt, params)
    rows: list[dict[str, float]] = []
    while engine.has_unfinished():
        timer.spent = dict.fromkeys(_PARTS, 0.0)
        start = time.perf_counter()
        engine.step()
        step = time.perf_counter() - start
        running = len(sched.running)
        if running == batch and not sched.waiting:
            rows.append({**timer.spent, "step": step})
    del sched.schedule, sched.update, runner.execute, outputs.process
    result = {k: statistics.median(r[k] for r in rows) for k in (*_PARTS, "step")}
    result["bookkeeping"] = statistics.median(r["step"] - r["execute"] for r in rows)
    result["steps"] = len(rows)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--integrity", default="standard")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=24)
    args = ap.parse_args()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        integrity=args.integrity,
        max_num_seqs=max(args.batch),
        max_num_batched_tokens=max(2048, max(args.batch) * args.prompt_len),
    )
    # A warm-up batch, so one-off costs (allocator, kernels) stay out of the figures.
    measure(llm, min(args.batch), args.prompt_len, 4)
    print(f"{args.dtype}, integrity={args.integrity}, {args.prompt_len} prompt tokens")
    for batch in args.batch:
        r = measure(llm, batch, args.prompt_len, args.output_len)
        ms = {k: r[k] * 1e3 for k in (*_PARTS, "step", "bookkeeping")}
        share = 100 * r["bookkeeping"] / r["execute"]
        print(
            f"batch={batch}: median of {r['steps']:.0f} decode steps: step {ms['step']:.1f} ms, "
            f"runner.execute {ms['execute']:.1f} ms; bookkeeping {ms['bookkeeping']:.2f} ms "
            f"(schedule {ms['schedule']:.2f}, update {ms['update']:.2f}, "
            f"outputs {ms['outputs']:.2f}) = {share:.2f}% of the runner's step (target < 1%)"
        )


if __name__ == "__main__":
    main()
