"""Integrity overhead: the throughput workload at each integrity level, in one process.

    python bench/integrity_overhead.py                 # 64 prompts x 128 tokens, 128 out
    python bench/integrity_overhead.py --num-prompts 32 --output-len 64 --runs 3

One model load; each run builds one fresh engine per level with the same prompts
(greedy, ignore EOS) and steps them interleaved, one step of each in turn (the order
rotates every step), timing only each engine's own steps. A load change on the machine
then hits every level alike, which a level-after-level run (minutes apart) does not: on
this shared 2-core machine that spread alone was +-5%. Prints each level's median output
tok/s and its ratio to ``off``, plus the median of the per-run ratios. The greedy tokens
of every level must equal ``off``'s.
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


def run_levels(
    levels: list[str], loaded, prompts: list[list[int]], output_len: int, args: argparse.Namespace
) -> dict[str, tuple[float, dict[str, list[int]]]]:
    """Output tok/s of each level, and its tokens per request, stepped interleaved."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engines = {}
    for level in levels:
        engine = EngineCore(
            EngineConfig(
                model=args.model,
                dtype=args.dtype,
                integrity=level,
                kv_cache_memory=args.kv_cache_memory,
            ),
            loaded,
        )
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        engines[level] = engine
    busy = {level: 0.0 for level in levels}
    tokens: dict[str, dict[str, list[int]]] = {level: {} for level in levels}
    turn = 0
    while any(e.has_unfinished() for e in engines.values()):
        order = levels[turn % len(levels) :] + levels[: turn % len(levels)]
        turn += 1
        for level in order:
            engine = engines[level]
            if not engine.has_unfinished():
                continue
            start = time.perf_counter()
            outs = engine.step()
            busy[level] += time.perf_counter() - start
            for out in outs:
                if out.finished:
                    tokens[level][out.request_id] = out.outputs[0].token_ids
    result = {}
    for level, engine in engines.items():
        assert all(len(t) == output_len for t in tokens[level].values())
        failures = engine.stats().integrity.failures
        assert not failures, f"{level}: integrity failures on a clean run: {failures}"
        result[level] = (len(prompts) * output_len / busy[level], tokens[level])
    return result


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
    prompts = [
        [rng.randrange(100, vocab - 100) for _ in range(args.input_len)]
        for _ in range(args.num_prompts)
    ]
    run_levels(levels, loaded, prompts[:4], 4, args)  # warm-up (and kernel compile)

    speed: dict[str, list[float]] = {lv: [] for lv in levels}
    ratios: dict[str, list[float]] = {lv: [] for lv in levels}
    reference: dict[str, list[int]] | None = None
    for r in range(args.runs):
        this_run: dict[str, float] = {}
        results = run_levels(levels, loaded, prompts, args.output_len, args)
        for level in levels:
            tps, tokens = results[level]
            if reference is None:
                reference = tokens
            same = tokens == reference
            print(
                f"run {r + 1} {level:<9} {tps:7.1f} output tok/s  tokens equal: {same}", flush=True
            )
            speed[level].append(tps)
            this_run[level] = tps
        for level in levels:
            ratios[level].append(this_run[level] / this_run["off"])

    print(
        f"\n{args.num_prompts}x{args.input_len}/{args.output_len}, {args.dtype}, "
        f"{args.runs} runs (medians)"
    )
    off = statistics.median(speed["off"])
    for level in levels:
        med = statistics.median(speed[level])
        print(
            f"{level:<9} {med:7.1f} output tok/s   ratio to off {med / off:.3f}   "
            f"median per-run ratio {statistics.median(ratios[level]):.3f}"
        )


if __name__ == "__main__":
    main()
