"""Quantized GEMMs (kernels/cpu/quant: the int8 kernel and the bf16-decode kernel) against
the bf16 tile GEMM of ``--quantization none`` (kernels/cpu/gemm) at the default model's
shapes, side by side in one run: ms per call and the ratios. Columns: int8 (quant_int8.cpp:
the one-row GEMV, or its multi-row loop), int8-tiles (quant_int8_tiles.cpp, 2 rows and
more), bf16-decode (registers up to 4 rows, then quant_tiles.cpp) and none.

    python -m bench.quant_gemv [--rows 1 4 16 64] [--type Q4_1] [--iters 200]
    python -m bench.quant_gemv --cold 30 [--type Q4_1]   # weights streamed from memory
        [--cpu-time | --process-time] [--direct-max-rows N]

Weights are random blocks made by ``gguf.quants.quantize`` (Q4_0/1, Q5_0/1, Q8_0) or
random bytes with small scales (K-quants). Noisy on a shared machine: note ``uptime``.

By default each shape's one weight stays in cache between calls, timed by wall clock with
torch's threads (``--cpu-time``: one thread, its CPU time). ``--cold L`` keeps L
copies of every shape (as many layers; 2 of the lm_head) and cycles through them, so the
weights come from memory as they do end to end; one-row calls then also time the int8
kernel's multi-row loop (``PAGEWARDEN_INT8_ROW=0``, the kernel before the one-row GEMV)
and the bf16-decode column is left out. ``--process-time`` times the process's CPU time
instead (all threads, the pool's spin off, best of 3). ``--direct-max-rows``: the
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


#: The clock ``timed`` reads: wall time, or (``--cpu-time``) this thread's CPU time.
CLOCK = time.perf_counter


#: ``--process-time``: best of 3 runs timed by the process's CPU time (all threads).
PROCESS_TIME = False


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    if PROCESS_TIME:
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            for _ in range(iters):
                fn()
            best = min(best, (time.process_time() - t0) / iters * 1e3)
        return best
    t0 = CLOCK()
    for _ in range(iters):
        fn()
    return (CLOCK() - t0) / iters * 1e3


def cold(args: argparse.Namespace, rng: np.random.Generator) -> None:
    """Per shape, L copies of the weight (the lm_head: 2), cycled: ms per call from memory."""
    total: dict[str, float] = {}
    for n, k in SHAPES:
        qtype = NAMES["Q8_0"] if n == 49152 else NAMES[args.type]
        w = random_weight(qtype, n, k, rng)
        copies = 2 if n == 49152 else args.cold
        ws = [cpu_quant.QuantWeight(w.data.clone(), qtype, (n, k)) for _ in range(copies)]
        tiles = cpu_gemm.pack_tiles(w.dequantize().bfloat16())
        ts = [tiles.clone() for _ in range(copies)]
        x = torch.randn(1, k).bfloat16()
        sweeps = max(3, args.iters // copies)

        def row(x=x, ws=ws):
            for q in ws:
                cpu_quant.gemm(x, q, kernel="int8")

        def old(x=x, ws=ws):
            os.environ["PAGEWARDEN_INT8_ROW"] = "0"
            try:
                row(x, ws)
            finally:
                del os.environ["PAGEWARDEN_INT8_ROW"]

        def none(x=x, ts=ts, n=n):
            for t in ts:
                cpu_gemm.gemm(x, t, n)

        t8, to, tb = (timed(f, sweeps) / copies for f in (row, old, none))
        for key, t in (("int8", t8), ("old", to), ("none", tb)):
            total[key] = total.get(key, 0.0) + t
        print(
            f"{w.type_name:5s} N={n:6d} K={k:5d} M=1 cold x{copies}: int8 {t8:7.3f} ms  "
            f"int8 multi-row loop {to:7.3f} ms  none {tb:7.3f} ms  none/int8 {tb / t8:5.2f}x  "
            f"({w.nbytes / t8 / 1e6:5.1f} GB/s)"
        )
    print(
        f"sum of one layer's shapes + lm_head, M=1, cold: int8 {total['int8']:.3f} ms, "
        f"multi-row loop {total['old']:.3f} ms, none {total['none']:.3f} ms; "
        f"none/int8 {total['none'] / total['int8']:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--type", default="Q4_1", choices=sorted(NAMES))
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--cold", type=int, default=0, metavar="L", help="L copies per shape, cycled")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, timed by its CPU time (time.thread_time): per-core figures that a "
        "loaded machine's preemptions do not inflate (memory stalls still count)",
    )
    ap.add_argument(
        "--process-time",
        action="store_true",
        help="time the process's CPU time (all threads, the pool's spin off, best of 3)",
    )
    ap.add_argument("--direct-max-rows", type=int, default=None)
    args = ap.parse_args()
    global CLOCK, PROCESS_TIME
    if args.cpu_time:
        CLOCK = time.thread_time
        torch.set_num_threads(1)
    PROCESS_TIME = args.process_time
    print(f"uptime: {os.popen('uptime').read().strip()}; torch threads {torch.get_num_threads()}")
    rng = np.random.default_rng(0)
    cpu_gemm.load()
    ext = cpu_quant.load()
    if args.direct_max_rows is not None:
        ext.set_direct_max_rows(args.direct_max_rows)
    if args.process_time:
        from pagewarden.kernels.cpu import pool as cpu_pool

        cpu_pool.load().set_spin_us(0)
    if args.cold:
        cold(args, rng)
        print(f"uptime: {os.popen('uptime').read().strip()}")
        return
    total: dict[int, list[float]] = {}
    big = 1 << 30

    def int8(x, w, tiles_from: int) -> None:  # the int8 kernel, tiles from this many rows
        old = ext.set_int8_tiles_min_rows(tiles_from)
        try:
            cpu_quant.gemm(x, w, kernel="int8")
        finally:
            ext.set_int8_tiles_min_rows(old)

    for n, k in SHAPES:
        qtype = NAMES["Q8_0"] if n == 49152 else NAMES[args.type]
        w = random_weight(qtype, n, k, rng)
        tiles = cpu_gemm.pack_tiles(w.dequantize().bfloat16())
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            iters = max(5, args.iters // max(1, m // 8))
            t8 = timed(lambda x=x, w=w: int8(x, w, big), iters)
            tt = timed(lambda x=x, w=w: int8(x, w, 2), iters) if m > 1 else t8
            tq = timed(lambda x=x, w=w: cpu_quant.gemm(x, w, kernel="bf16"), iters)
            tb = timed(lambda x=x, t=tiles, n=n: cpu_gemm.gemm(x, t, n), iters)
            acc = total.setdefault(m, [0.0, 0.0, 0.0, 0.0])
            for i, t in enumerate((t8, tt, tq, tb)):
                acc[i] += t
            print(
                f"{w.type_name:5s} N={n:6d} K={k:5d} M={m:4d}  int8 {t8:8.3f} ms  "
                f"int8-tiles {tt:8.3f} ms  bf16-decode {tq:8.3f} ms  none {tb:8.3f} ms  "
                f"none/int8-tiles {tb / tt:5.2f}x  none/bf16-decode {tb / tq:5.2f}x"
            )
    for m, (t8, tt, tq, tb) in total.items():
        print(
            f"sum of one layer's shapes + lm_head, M={m}: int8 {t8:.3f} ms, int8-tiles "
            f"{tt:.3f} ms, bf16-decode {tq:.3f} ms, none {tb:.3f} ms; none/int8-tiles "
            f"{tb / tt:.2f}x, none/bf16-decode {tb / tq:.2f}x"
        )
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
