"""Single-stream decode with and without MKL's pre-packed weights (``single_row_linear``).

    python bench/linear_prepack.py                # default model, 1 x 128/64, 5 rounds

One process, one engine; rounds alternate packing on and off (the packed copies are
detached from the layers and put back), so a load change hits both alike. Prints each
round, the medians of output tok/s, their ratio, the share of greedy tokens that agree,
and a per-layer timing of the two wide layers at one row.
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


def _median_ms(fn, n: int = 40) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import torch

    from pagewarden import LLM, SamplingParams
    from pagewarden.models.llama import single_row_linear

    print(f"uptime: {os.popen('uptime').read().strip()}")
    llm = LLM(model=args.model, enable_prefix_caching=False)
    model = llm.engine.loaded.model
    linears = [model.lm_head, *(layer.mlp.gate_up_proj for layer in model.model.layers)]
    packed = [lin.__dict__.get("packed_single_row") for lin in linears]
    if packed[0] is None:
        raise SystemExit("no packed weights here (needs float32 compute on a CPU with MKL)")

    def use(on: bool) -> None:
        for lin, p in zip(linears, packed):
            lin.packed_single_row = p if on else None

    rng = random.Random(0)
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rates: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[int]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        prompt = [rng.randrange(3, vocab) for _ in range(args.input_len)]
        for on in (True, False) if r % 2 else (False, True):
            use(on)
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            rate = args.output_len / (time.perf_counter() - t0)
            if r:
                rates[on].append(rate)
                print(f"round {r} packing {'on ' if on else 'off'} {rate:6.1f} tok/s")
            tokens[on] = tokens.get(on, []) + list(out.outputs[0].token_ids)
    use(True)
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    same = sum(a == b for a, b in zip(tokens[True], tokens[False])) / len(tokens[True])
    print(f"single stream 1 x {args.input_len}/{args.output_len}, medians of {args.rounds}:")
    print(f"  packing on {on:.1f} tok/s, off {off:.1f} tok/s, ratio {on / off:.3f}")
    print(f"  greedy tokens equal on/off: {same:.1%}")
    x = torch.randn(1, model.config.hidden_size)
    for name, lin in (("lm_head", model.lm_head), ("gate_up_proj", linears[1])):
        a = _median_ms(lambda lin=lin: lin(x))
        b = _median_ms(lambda lin=lin: single_row_linear(lin, x))
        print(f"  {name} {tuple(lin.weight.shape)} one row: F.linear {a:.3f} ms, packed {b:.3f} ms")
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
