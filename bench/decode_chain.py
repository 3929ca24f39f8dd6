"""One stream with the decode chain against the per-layer path, in one process.

    python bench/decode_chain.py                          # the default SmolLM2 Q4_1
    python bench/decode_chain.py --model GEMMA.gguf --rounds 8

One ``LLM`` (quantization gguf, prefix caching off); its model's decode chain
(``models/decode_chain.py``) is switched on and off between rounds, the order alternated;
each round generates 128 greedy tokens (ignore_eos) after a short random prompt. Prints
the median time per generated token of each, their ratio, the per-round ratios and
whether the greedy tokens were equal (they must be: the chain computes the same bits).
Note ``uptime`` beside the figures: only the ratio means something on a shared machine.
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

from pagewarden import LLM, SamplingParams  # noqa: E402
from pagewarden.models.decode_chain import DecodeChain  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--integrity", default="standard")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    llm = LLM(
        model=args.model,
        quantization="gguf",
        kv_cache_memory="256MiB",
        enable_prefix_caching=False,
        integrity=args.integrity,
    )
    model = llm.engine.loaded.model
    chain = DecodeChain.build(model.model.layers)
    if chain is None:
        raise SystemExit("no decode chain for this model or build (see models/decode_chain.py)")
    rng = random.Random(1)
    vocab = llm.get_tokenizer().vocab_size
    prompt = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.prompt_len)]}]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    print(f"uptime: {os.popen('uptime').read().strip()}", flush=True)
    times: dict[str, list[float]] = {"per-layer": [], "chain": []}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        order = ["per-layer", "chain"] if r % 2 == 0 else ["chain", "per-layer"]
        for mode in order:
            model._decode_chain = chain if mode == "chain" else None
            start = time.perf_counter()
            out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            times[mode].append(time.perf_counter() - start)
            tokens.setdefault(mode, list(out))
    med = {k: statistics.median(v) / args.tokens * 1e3 for k, v in times.items()}
    ratios = [round(c / p, 3) for c, p in zip(times["chain"], times["per-layer"])]
    print(f"per-layer {med['per-layer']:.3f} ms/token, chain {med['chain']:.3f} ms/token: "
          f"chain / per-layer {med['chain'] / med['per-layer']:.3f}x; per round {ratios}")  # fmt: skip
    print(f"greedy tokens equal: {tokens['chain'] == tokens['per-layer']}")
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
