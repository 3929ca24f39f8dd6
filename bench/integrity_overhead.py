"""Integrity overhead: the throughput workload at each integrity level, in one process.

    python bench/integrity_overhead.py                 # 64 prompts x 128 tokens, 128 out
    python bench/integrity_overhead.py --num-prompts 32 --output-len 64 --runs 3

One model load; each run times every level once (the order rotates from run to run so
no level always goes first), on a fresh engine with the same prompts, greedy, ignore
EOS. Prints each level's median output tok/s and its ratio to ``off``, plus the median
of the per-run ratios (each level against ``off`` of the same run), which is the figure
to read on a noisy machine. The greedy tokens of every level must equal ``off``'s.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagewarden.engine.config import EngineConfig  # noqa: E402
from pagewarden.engine.core import EngineCore  # noqa: E402
from pagewarden.models.loader import load_model  # noqa: E402
from pagewarden.sampling_params import SamplingParams  # noqa: E402

LEVELS = ("off", "audit", "standard", "strict")


def run_level(level: str, loaded, prompts: list[list[int]], output_len: int,
              args: argparse.Namespace) -> tuple[float, dict[str, list[int]]]:
    """Output tok/s of one level, and its tokens per request."""
    engine = EngineCore(EngineConfig(model=args.model, dtype=args.dtype, integrity=level,
                                     kv_cache_memory=args.kv_cache_memory), loaded)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    elapsed = time.perf_counter() - start
    assert all(len(t) == output_len for t in tokens.values())
    failures = engine.stats().integrity.failures
    assert not failures, f"{level}: integrity failures on a clean run: {failures}"
    return len(prompts) * output_len / elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--levels", default=",".join(LEVELS))
    args = ap.parse_args()
    levels = args.levels.split(",")
    if "off" not in levels:
        levels.insert(0, "off")

    loaded = load_model(args.model, EngineConfig(dtype=args.dtype).torch_dtype)
    rng = random.Random(0)
    vocab = loaded.config.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    run_level("off", loaded, prompts[:4], 4, args)          # warm-up

    speed: dict[str, list[float]] = {lv: [] for lv in levels}
    ratios: dict[str, list[float]] = {lv: [] for lv in levels}
    reference: dict[str, list[int]] | None = None
    for r in range(args.runs):
        order = levels[r % len(levels):] + levels[:r % len(levels)]
        this_run: dict[str, float] = {}
        for level in order:
            tps, tokens = run_level(level, loaded, prompts, args.output_len, args)
            if reference is None:
                reference = tokens
            same = tokens == reference
            print(f"run {r + 1} {level:<9} {tps:7.1f} output tok/s  tokens equal: {same}",
                  flush=True)
            speed[level].append(tps)
            this_run[level] = tps
        for level in levels:
            ratios[level].append(this_run[level] / this_run["off"])

    print(f"\n{args.num_prompts}x{args.input_len}/{args.output_len}, {args.dtype}, "
          f"{args.runs} runs (medians)")
    off = statistics.median(speed["off"])
    for level in levels:
        med = statistics.median(speed[level])
        print(f"{level:<9} {med:7.1f} output tok/s   ratio to off {med / off:.3f}   "
              f"median per-run ratio {statistics.median(ratios[level]):.3f}")


if __name__ == "__main__":
    main()
