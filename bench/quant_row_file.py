"""The one-row int8 GEMV (kernels/cpu/quant_int8_row.h) on a GGUF file's own weights: for
each kind of layer tensor (attn_q, ffn_down, ...; one row per kind and type), the time of
one call and the bandwidth it reaches, cycling through every layer's copy so the weights
come from memory as in a decode step. Also the lm_head (token_embd) and, for comparison,
a plain torch sum over the same bytes (the machine's streaming rate).

    python -m bench.quant_row_file [--model FILE] [--sweeps 40] [--cpu-time]

Noisy on a shared machine: note ``uptime`` (printed). Times are medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch

from pagewarden.kernels.cpu import quant as cpu_quant

DEFAULT = "/root/.cache/pagewarden/gguf/gemma-3-270m-q4_k_m.gguf"


def file_weights(path: str) -> dict[tuple[str, str], list[cpu_quant.QuantWeight]]:
    """(tensor kind, type name) -> one QuantWeight per layer, views of the file's map."""
    import gguf

    from pagewarden.models.gguf_weights import gguf_weight

    reader = gguf.GGUFReader(path)
    kinds: dict[tuple[str, str], list[cpu_quant.QuantWeight]] = collections.defaultdict(list)
    for t in reader.tensors:
        w = gguf_weight(t, True)
        if not isinstance(w, cpu_quant.QuantWeight):
            continue
        kind = t.name.split(".", 2)[2] if t.name.startswith("blk.") else t.name
        kinds[(kind, w.type_name)].append(w)
    return kinds


#: The clock ``timed`` reads: wall time, or (``--cpu-time``) this thread's CPU time.
CLOCK = time.perf_counter


def timed(fn, sweeps: int, rounds: int) -> float:
    """Median over ``rounds`` of the seconds one sweep takes."""
    fn()
    times = []
    for _ in range(rounds):
        t0 = CLOCK()
        for _ in range(sweeps):
            fn()
        times.append((CLOCK() - t0) / sweeps)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT)
    ap.add_argument("--sweeps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, timed by its CPU time: per-core figures that a loaded machine's "
        "preemptions do not inflate (memory stalls still count)",
    )
    args = ap.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.thread_time
        torch.set_num_threads(1)
    print(f"uptime: {os.popen('uptime').read().strip()}; torch threads {torch.get_num_threads()}")
    ext = cpu_quant.load()
    assert ext is not None
    total_us = 0.0
    for (kind, name), ws in sorted(file_weights(args.model).items()):
        x = torch.randn(1, ws[0].shape[1]).bfloat16()
        sweeps = args.sweeps if len(ws) > 1 else max(3, args.sweeps // 8)

        def direct(x=x, ws=ws):
            for w in ws:
                ext.gemv_auto(x, w.data, w.qtype, None, False, False)

        def python(x=x, ws=ws):
            for w in ws:
                cpu_quant.gemm(x, w)

        t = timed(direct, sweeps, args.rounds) / len(ws)
        tp = timed(python, sweeps, args.rounds) / len(ws)
        total_us += tp * len(ws) * 1e6
        nbytes = ws[0].nbytes
        print(
            f"{kind:20s} {name:5s} x{len(ws):2d} N={ws[0].shape[0]:6d} K={ws[0].shape[1]:5d} "
            f"{nbytes / 1e3:8.1f} kB: {t * 1e6:8.1f} us ({nbytes / t / 1e9:5.1f} GB/s), "
            f"through quant.gemm {tp * 1e6:8.1f} us"
        )
    print(f"all of the above once per layer (through quant.gemm): {total_us / 1e3:.2f} ms")
    big = torch.empty(178 * 2**20, dtype=torch.uint8).random_().view(torch.int64)
    t = timed(lambda: big.sum(), 3, args.rounds)
    print(f"torch sum over {big.numel() * 8 / 1e6:.0f} MB: {big.numel() * 8 / t / 1e9:.1f} GB/s")
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
