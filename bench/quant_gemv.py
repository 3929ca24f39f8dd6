"""Quantized GEMMs (kernels/cpu/quant: the int8 kernel and the bf16-decode kernel) against
the bf16 tile GEMM of ``--quantization none`` (kernels/cpu/gemm) at the default model's
shapes, side by side in one run: ms per call and the ratios.

    python -m bench.quant_gemv [--rows 1 4 16 64] [--type Q4_1] [--iters 200]
        [--cpu-time] [--direct-max-rows N]

Weights are random blocks made by ``gguf.quants.quantize`` (Q4_0/1, Q5_0/1, Q8_0) or
random bytes with small scales (K-quants). Noisy on a shared machine: note ``uptime``;
``--cpu-time`` times the process's CPU time (all threads, the pool's spin off, best of 3)
instead of wall time, which a loaded machine disturbs less. ``--direct-max-rows``: the
bf16-decode kernel's switch from decoding in registers to packed tiles (quant.cpp).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from pagewarden.kernels.cpu import gemm as cpu_gemm
from pagewarden.kernels.cpu import quant as cpu_quant

# SmolLM2-135M: (N, K) of qkv, o_proj, gate_up, down, lm_head (tied Q8_0 embedding).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
NAMES = {name: code for code, (name, _, _) in cpu_quant.KERNEL_TYPES.items()}


def random_weight(qtype: int, n: int, k: int, rng: np.random.Generator) -> cpu_quant.QuantWeight:
    import gguf

    name, per_block, block_bytes = cpu_quant.KERNEL_TYPES[qtype]
    try:
        blocks = gguf.quants.quantize(
            rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType(qtype)
        )
    except NotImplementedError:
        raw = rng.integers(0, 256, (n, k // per_block, block_bytes), dtype=np.uint8)
        scale = np.frombuffer(np.full(raw.shape[:2], 0.01, np.float16).tobytes(), np.uint8)
        at = 208 if name == "Q6_K" else 0
        raw[..., at : at + 2] = scale.reshape(*raw.shape[:2], 2)
        if name != "Q6_K":
            raw[..., 2:4] = scale.reshape(*raw.shape[:2], 2)
        blocks = raw.reshape(n, -1)
    return cpu_quant.QuantWeight(torch.from_numpy(np.ascontiguousarray(blocks)), qtype, (n, k))


CPU_TIME = False


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    if CPU_TIME:
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            for _ in range(iters):
                fn()
            best = min(best, (time.process_time() - t0) / iters * 1e3)
        return best
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--type", default="Q4_1", choices=sorted(NAMES))
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--direct-max-rows", type=int, default=None)
    args = ap.parse_args()
    global CPU_TIME
    CPU_TIME = args.cpu_time
    print(f"uptime: {os.popen('uptime').read().strip()}; torch threads {torch.get_num_threads()}")
    rng = np.random.default_rng(0)
    cpu_gemm.load()
    ext = cpu_quant.load()
    if args.direct_max_rows is not None:
        ext.set_direct_max_rows(args.direct_max_rows)
    if args.cpu_time:
        from pagewarden.kernels.cpu import pool as cpu_pool

        cpu_pool.load().set_spin_us(0)
    total: dict[int, list[float]] = {}
    for n, k in SHAPES:
        qtype = NAMES["Q8_0"] if n == 49152 else NAMES[args.type]
        w = random_weight(qtype, n, k, rng)
        tiles = cpu_gemm.pack_tiles(w.dequantize().bfloat16())
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            iters = max(5, args.iters // max(1, m // 8))
            t8 = timed(lambda x=x, w=w: cpu_quant.gemm(x, w, kernel="int8"), iters)
            tq = timed(lambda x=x, w=w: cpu_quant.gemm(x, w, kernel="bf16"), iters)
            tb = timed(lambda x=x, t=tiles, n=n: cpu_gemm.gemm(x, t, n), iters)
            acc = total.setdefault(m, [0.0, 0.0, 0.0])
            for i, t in enumerate((t8, tq, tb)):
                acc[i] += t
            print(
                f"{w.type_name:5s} N={n:6d} K={k:5d} M={m:4d}  int8 {t8:8.3f} ms  "
                f"bf16-decode {tq:8.3f} ms  none {tb:8.3f} ms  none/int8 {tb / t8:5.2f}x  "
                f"none/bf16-decode {tb / tq:5.2f}x"
            )
    for m, (t8, tq, tb) in total.items():
        print(
            f"sum of one layer's shapes + lm_head, M={m}: int8 {t8:.3f} ms, bf16-decode "
            f"{tq:.3f} ms, none {tb:.3f} ms; none/int8 {tb / t8:.2f}x, none/bf16-decode "
            f"{tb / tq:.2f}x"
        )
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
