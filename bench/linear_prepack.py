"""Decode with and without packed GEMM weights (``models/packed_linear.py``).

    python bench/linear_prepack.py                     # default model, batch 1 and 64
    python bench/linear_prepack.py --batch 16 --output-len 32 --rounds 3

One process, one engine (prefix caching off); rounds alternate packing on and off (every
linear layer's packed copy is dropped and rebuilt), so a load change hits both alike. For
each batch size: ``--batch`` prompts of ``--input-len`` random tokens, ``--output-len``
greedy tokens each; prints each round, the medians of output tok/s, their ratio and the
share of greedy tokens that agree (float32 and the packed kernels round differently, so
a near-tie may flip; bf16 more so). Note ``uptime`` beside the figures.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from torch import nn

    from pagewarden import LLM, SamplingParams
    from pagewarden.models import packed_linear

    print(f"uptime: {os.popen('uptime').read().strip()}")
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False)
    model = llm.engine.loaded.model
    param = next(model.parameters())
    packing = packed_linear.pick_packing(param.dtype, param.device)
    if packing is None:
        raise SystemExit(f"no packing for {param.dtype} on this machine")
    print(f"compute dtype {param.dtype}, packing {packing}")
    wide = {id(model.lm_head)} | {id(layer.mlp.gate_up_proj) for layer in model.model.layers}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]

    def use(on: bool) -> None:
        for lin in linears:
            packed_linear.pack(lin, packing if on else None, wide=id(lin) in wide)

    rng = random.Random(0)
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for batch in args.batch:
        rates: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, list[int]] = {True: [], False: []}
        for r in range(args.rounds + 1):  # round 0 warms up
            prompts = [
                {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.input_len)]}
                for _ in range(batch)
            ]
            for on in (True, False) if r % 2 else (False, True):
                use(on)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                rate = batch * args.output_len / (time.perf_counter() - t0)
                tokens[on] += [t for o in outs for t in o.outputs[0].token_ids]
                if r:
                    rates[on].append(rate)
                    print(
                        f"batch {batch} round {r} packing {'on ' if on else 'off'} {rate:7.1f} tok/s"
                    )
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        same = sum(a == b for a, b in zip(tokens[True], tokens[False])) / len(tokens[True])
        print(
            f"batch {batch} x {args.input_len}/{args.output_len}, medians of {args.rounds}: "
            f"packing on {on:.1f} tok/s, off {off:.1f} tok/s, ratio {on / off:.3f}; "
            f"greedy tokens equal {same:.1%}"
        )
    use(True)
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
