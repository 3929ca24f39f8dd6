"""End-to-end decode speed of ``--quantization none`` against ``gguf`` (each quantized
GEMM kernel: int8, bf16-decode, and the ``auto`` rule), side by side in one process,
alternated rounds, median tok/s:

    python -m bench.quant_decode [--model FILE] [--streams 1 64] [--input-len 128]
                                 [--output-len 128] [--rounds 3]

One stream: generated tokens / wall time of one request (prefill included, as llama-bench's
tg is not: the prefill is one call). Batch: total generated tokens / wall time of
``streams`` requests at once. Noisy on a shared machine: ``uptime`` is printed beside.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from pagewarden import LLM
from pagewarden.kernels.cpu import quant as cpu_quant
from pagewarden.sampling_params import SamplingParams

VARIANTS = {
    "none": ("none", None),
    "gguf-int8": ("gguf", "int8"),
    "gguf-bf16-decode": ("gguf", "bf16"),
    "gguf-auto": ("gguf", None),
}


def run(llm: LLM, streams: int, input_len: int, output_len: int) -> float:
    prompts = [
        {"prompt_token_ids": [(7 * i + 13 * j) % 5000 + 100 for j in range(input_len)]}
        for i in range(streams)
    ]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, nargs="+", default=[1])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    print(f"uptime: {os.popen('uptime').read().strip()}")
    engines = {}
    for quant in sorted({VARIANTS[v][0] for v in args.variants}):
        engines[quant] = LLM(model=args.model, quantization=quant, kv_cache_memory="1GiB")
    for streams in args.streams:
        results: dict[str, list[float]] = {v: [] for v in args.variants}
        for _ in range(args.rounds):
            for v in args.variants:
                quant, kernel = VARIANTS[v]
                cpu_quant.FORCED_KERNEL = kernel
                results[v].append(run(engines[quant], streams, args.input_len, args.output_len))
        cpu_quant.FORCED_KERNEL = None
        base = statistics.median(results["none"]) if "none" in results else None
        for v, r in results.items():
            med = statistics.median(r)
            ratio = f"  {med / base:.2f}x none" if base else ""
            print(
                f"streams={streams:3d} {args.input_len}/{args.output_len} {v:17s} "
                f"median {med:8.1f} tok/s  rounds {[round(x, 1) for x in r]}{ratio}"
            )
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
