"""64 streams x 128/128 under ``--quantization gguf`` and ``none`` in one process: both
engines loaded side by side, the modes alternated per round, each round timing the 64
prompts' prefill (max_tokens=1) and the whole request (max_tokens=129) as
bench/llamacpp.py's child does, but with no fresh process per mode (faster, and the two
modes see the same machine state; bench/llamacpp.py is the reference figure).

    python bench/quant_streams.py [--model FILE] [--rounds 3]

Prints per round S_PP (prompt tok/s), S_TG (decode tok/s) and S (all tokens / time) per
mode and gguf / none of S; then the medians. Note ``uptime`` (printed) beside figures.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.llamacpp import N_GEN, N_PROMPT, STREAMS, pagewarden_figures  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: SmolLM2 Q4_1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from pagewarden import LLM, SamplingParams

    modes = ("gguf", "none")
    llms = {
        q: LLM(
            model=args.model,
            quantization=q,
            cpu_threads=args.threads,
            kv_cache_memory="640MiB",
            max_num_seqs=STREAMS,
            enable_prefix_caching=False,
        )
        for q in modes
    }
    rng = random.Random(1)
    vocab = llms["gguf"].get_tokenizer().vocab_size

    def timed(llm: LLM, n: int, max_tokens: int) -> float:
        ids = [[rng.randrange(100, vocab) for _ in range(N_PROMPT)] for _ in range(n)]
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": x} for x in ids], sp, use_tqdm=False)
        return time.perf_counter() - t0

    for q in modes:  # warm-up: kernels built, buffers grown
        timed(llms[q], 1, 8)
        timed(llms[q], STREAMS, 4)
    t1: dict[str, list[float]] = {q: [] for q in modes}
    tf: dict[str, list[float]] = {q: [] for q in modes}
    print(f"uptime: {os.popen('uptime').read().strip()}")

    def figures(a: float, b: float) -> tuple[float, float, float]:
        f = pagewarden_figures([a], [b], STREAMS)
        return f["pp"], f["tg"], f["pg"]

    for r in range(args.rounds):
        for q in modes if r % 2 == 0 else modes[::-1]:
            t1[q].append(timed(llms[q], STREAMS, 1))
            tf[q].append(timed(llms[q], STREAMS, N_GEN + 1))
        parts = []
        for q in modes:
            pp, tg, s = figures(t1[q][-1], tf[q][-1])
            parts.append(f"{q} S_PP {pp:.0f} S_TG {tg:.0f} S {s:.0f}")
        ratio = tf["none"][-1] / tf["gguf"][-1]
        print(f"round {r}: " + " | ".join(parts) + f" | S gguf/none {ratio:.3f}", flush=True)
    med = {q: figures(statistics.median(t1[q]), statistics.median(tf[q])) for q in modes}
    for q in modes:
        print(f"median {q}: S_PP {med[q][0]:.0f} S_TG {med[q][1]:.0f} S {med[q][2]:.0f}")
    print(f"S gguf / none of the medians {med['gguf'][2] / med['none'][2]:.3f}")
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
