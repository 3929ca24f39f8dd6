"""Decode attention candidates on this machine: gather + SDPA vs a numba in-place kernel.

    python bench/attention_kernels.py                  # batch 64 and 1, context 192
    python bench/attention_kernels.py --batch 64 --context 512

SmolLM2-135M's attention shape (3 kv heads, 3 query heads each, head_dim 64), a bf16
cache of 16-token blocks in shuffled order. Candidates, each checked against float32
SDPA on the gathered K/V before it is timed:

    gather+sdpa bf16   what pagewarden runs: index_select of whole blocks, SDPA in bf16
    gather+sdpa fp32   the same with K/V cast up to float32
    numba in place     `decode_in_place` below: reads blocks through the block table,
                       no gathered copy, query heads grouped per kv head

Prints the median time per call of each and its ratio to what pagewarden runs. Needs numba,
which pagewarden no longer depends on (``pip install numba``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numba
import numpy as np
import torch
import torch.nn.functional as F


@numba.njit(parallel=True, fastmath=True, cache=True)
def decode_in_place(q, cache, tables, seq_lens, scale, out):  # pragma: no cover - numba
    """Paged decode attention reading K/V in place.

    Layouts: q (S, n_kv, G, D) float32, the G query heads of each kv head adjacent;
    cache (2, num_blocks, block_size, n_kv, D) uint16 holding bf16 bits; tables
    (S, max_blocks) int64 block ids; seq_lens (S,) keys per sequence; out like q.
    Loop order: one (sequence, kv head) job per parallel iteration; for each block of
    its table, the block's K/V rows of that head are widened to float32 once (bf16 bits
    shifted into the high half of a float32), then for each of the G query heads the
    block's scores, an online-softmax rescale, and the V accumulation. Checks nothing:
    the caller guarantees every table entry < num_blocks and seq_lens within the tables.
    """
    num_seqs, n_kv, group, head_dim = q.shape
    block_size = cache.shape[2]
    for job in numba.prange(num_seqs * n_kv):
        s, h = job // n_kv, job % n_kv
        kbits = np.empty((block_size, head_dim), np.uint32)
        vbits = np.empty((block_size, head_dim), np.uint32)
        kf, vf = kbits.view(np.float32), vbits.view(np.float32)
        scores = np.empty((group, block_size), np.float32)
        acc = np.zeros((group, head_dim), np.float32)
        run_max = np.full(group, -np.inf, np.float32)
        run_sum = np.zeros(group, np.float32)
        n = seq_lens[s]
        for b in range((n + block_size - 1) // block_size):
            blk = tables[s, b]
            cnt = min(block_size, n - b * block_size)
            for t in range(cnt):
                for d in range(head_dim):
                    kbits[t, d] = np.uint32(cache[0, blk, t, h, d]) << 16
                    vbits[t, d] = np.uint32(cache[1, blk, t, h, d]) << 16
            for g in range(group):
                m = run_max[g]
                for t in range(cnt):
                    x = np.float32(0.0)
                    for d in range(head_dim):
                        x += q[s, h, g, d] * kf[t, d]
                    scores[g, t] = x * scale
                    m = max(m, scores[g, t])
                corr = math.exp(run_max[g] - m)
                run_sum[g] *= corr
                for d in range(head_dim):
                    acc[g, d] *= corr
                run_max[g] = m
                for t in range(cnt):
                    p = math.exp(scores[g, t] - m)
                    run_sum[g] += p
                    for d in range(head_dim):
                        acc[g, d] += p * vf[t, d]
        for g in range(group):
            for d in range(head_dim):
                out[s, h, g, d] = acc[g, d] / run_sum[g]


def _time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(batch: int, context: int, reps: int) -> None:
    n_kv, group, head_dim, bs = 3, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    blocks = -(-context // bs)
    cache = torch.randn(2, batch * blocks + 1, bs, n_kv, head_dim, generator=g).bfloat16()
    tables = (torch.randperm(batch * blocks, generator=g) + 1).view(batch, blocks)
    index = tables.reshape(-1)
    q = torch.randn(batch, n_kv, group, head_dim, generator=g)
    scale = head_dim**-0.5

    def gathered(dtype):
        kv = cache.index_select(1, index).view(2, batch, blocks * bs, n_kv, head_dim)
        kv = kv[:, :, :context].permute(0, 1, 3, 2, 4).to(dtype)  # (2, S, n_kv, K, D)
        return F.scaled_dot_product_attention(q.to(dtype), kv[0], kv[1], scale=scale).float()

    qn, out = q.numpy(), np.empty((batch, n_kv, group, head_dim), np.float32)
    cache_bits = cache.view(torch.int16).numpy().view(np.uint16)
    lens = np.full(batch, context, np.int64)

    def numba_in_place():
        decode_in_place(qn, cache_bits, tables.numpy(), lens, np.float32(scale), out)
        return torch.from_numpy(out)

    ref = gathered(torch.float32)
    candidates = {
        "gather+sdpa bf16": lambda: gathered(torch.bfloat16),
        "gather+sdpa fp32": lambda: gathered(torch.float32),
        "numba in place": numba_in_place,
    }
    base = None
    print(f"batch {batch}, context {context}, {torch.get_num_threads()} threads")
    for name, fn in candidates.items():
        err = (fn() - ref).abs().max().item()
        assert err < 2e-2, f"{name} differs from the reference by {err}"
        t = _time(fn, reps)
        base = base or t
        print(f"  {name:<18} {t * 1e3:8.3f} ms   {t / base:5.2f}x of gather+sdpa bf16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    for batch in args.batch:
        run(batch, args.context, args.reps)


if __name__ == "__main__":
    main()
