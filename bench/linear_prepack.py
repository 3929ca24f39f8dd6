"""Decode with two packings of the GEMM weights (``kernels/cpu/linear.py``).

    python bench/linear_prepack.py                     # picked packing vs none, batch 1, 64
    python bench/linear_prepack.py --packings tiles onednn      # our bf16 kernel vs oneDNN
    python bench/linear_prepack.py --packings tiles onednn --gemm-only --batch 1 64 2048

One process, one engine (prefix caching off); rounds alternate the two packings (every
linear layer's packed copy is dropped and rebuilt), so a load change hits both alike. For
each batch size: ``--batch`` prompts of ``--input-len`` random tokens, ``--output-len``
greedy tokens each; prints each round, the medians of output tok/s, their ratio and the
share of greedy tokens that agree (float32 and the packed kernels round differently, so
a near-tie may flip; bf16 more so). ``--gemm-only`` times just the decoder's linear
layers (all of them, in model order, with the fused epilogues the model uses) on random
rows, per batch size: median ms per pass of every layer. Note ``uptime`` beside figures.
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
    ap.add_argument(
        "--packings", nargs=2, default=None, metavar=("A", "B"),
        help="two of tiles, onednn, mkl, none (default: the picked one and none)",
    )  # fmt: skip
    ap.add_argument("--gemm-only", action="store_true", help="time the linear layers alone")
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the engine's default, before torch loads

    from torch import nn

    from pagewarden import LLM, SamplingParams
    from pagewarden.kernels.cpu import linear as cpu_linear

    print(f"uptime: {os.popen('uptime').read().strip()}")
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False)
    model = llm.engine.loaded.model
    param = next(model.parameters())
    picked = cpu_linear.pick_packing(param.dtype, param.device)
    a, b = args.packings or (picked, "none")
    if a is None:
        raise SystemExit(f"no packing for {param.dtype} on this machine")
    names = {True: a, False: b}
    packings = {on: None if name == "none" else name for on, name in names.items()}
    print(f"compute dtype {param.dtype}, packings {a} / {b}")
    gate_up = {id(layer.mlp.gate_up_proj) for layer in model.model.layers}
    wide = {id(model.lm_head)} | gate_up
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]

    def use(on: bool) -> None:
        for lin in linears:
            cpu_linear.pack(lin, packings[on], wide=id(lin) in wide, gate_up=id(lin) in gate_up)

    if args.gemm_only:
        gemm_only(model, use, names, args)
        return

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
                    print(f"batch {batch} round {r} {names[on]:>7} {rate:7.1f} tok/s")
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        same = sum(x == y for x, y in zip(tokens[True], tokens[False])) / len(tokens[True])
        print(
            f"batch {batch} x {args.input_len}/{args.output_len}, medians of {args.rounds}: "
            f"{a} {on:.1f} tok/s, {b} {off:.1f} tok/s, ratio {on / off:.3f}; "
            f"greedy tokens equal {same:.1%}"
        )
    use(True)
    print(f"uptime: {os.popen('uptime').read().strip()}")


def gemm_only(model, use, names: dict[bool, str], args: argparse.Namespace) -> None:
    """Median ms of one pass over every decoder linear layer, per batch and packing."""
    import torch

    from pagewarden.kernels.cpu.linear import linear, linear_add, linear_gated

    cfg = model.config
    dtype = next(model.parameters()).dtype

    def one_pass(rows: int) -> None:
        x = torch.randn(rows, cfg.hidden_size, dtype=dtype)
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linear(attn.qkv_proj, x)
            h = linear_add(attn.o_proj, x[:, : attn.q_size].contiguous(), x)
            linear_add(mlp.down_proj, linear_gated(mlp.gate_up_proj, h, "silu"), x)

    with torch.inference_mode():
        for batch in args.batch:
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.rounds * 2 + 1):
                for on in (True, False) if r % 2 else (False, True):
                    use(on)
                    one_pass(batch)  # warm
                    t0 = time.perf_counter()
                    one_pass(batch)
                    if r:
                        times[on].append(time.perf_counter() - t0)
            ms = {on: statistics.median(t) * 1e3 for on, t in times.items()}
            print(
                f"decoder GEMMs, {batch} rows: {names[True]} {ms[True]:.2f} ms, "
                f"{names[False]} {ms[False]:.2f} ms, ratio {ms[False] / ms[True]:.3f}"
            )
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
