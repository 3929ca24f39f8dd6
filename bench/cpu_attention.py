"""Decode attention of one layer: the torch path (gather + SDPA) vs the C++ cpu kernel.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD python bench/cpu_attention.py
    ... --cases 64x192 1x256 --dtypes bfloat16 float32 --repeats 50

SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head_dim 64), 16-token blocks
in shuffled order, every sequence decoding one token. Timed per case and cache dtype,
each through ``AttentionOps.attend`` as a model layer calls it:

    torch           TorchAttention: index_select of whole blocks, SDPA in the cache dtype
    cpu             CpuAttention: the kernel reads K/V in place through the block table
    cpu+tags        the same with the slot tags checked as it reads (integrity audit and
                    up; the torch backend's guard checks tags after the step instead)

The kernel's output is checked against the torch path's before timing. Prints the
median time per call and each row's ratio to ``torch`` measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the engine's default, before torch loads

import torch

from pagewarden.kernels.attention import AttentionMetadata, TorchAttention
from pagewarden.kernels.cpu import attention as cpu_attention
from pagewarden.worker.fused_checks import allocate_read_checks

N_HEADS, N_KV, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_case(batch: int, context: int, dtype: torch.dtype, seed: int = 0):
    """(q, cache, meta) of `batch` decodes over `context` cached tokens each."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-(context + 1) // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    slots = [t[context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE for t in tables]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, slots, BLOCK_SIZE)
    shape = (2, num_blocks, BLOCK_SIZE, N_KV, HEAD_DIM)
    cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(batch, N_HEADS, HEAD_DIM, generator=gen).to(dtype)
    # Tags that match: every slot's tag is its slot number.
    meta.slot_tags = torch.arange(num_blocks * BLOCK_SIZE, dtype=torch.int64)
    index = meta.block_index.view(batch, -1)
    pos = torch.arange(context + 1)
    expected = index[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE  # (S, K)
    return q, cache, meta, expected


def median_ms(fn, repeats: int) -> float:
    fn()  # warm up (and the extension's first call)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def time_case(batch: int, context: int, dtype: torch.dtype, repeats: int):
    """[(backend, median ms per call)] of one case, the kernel checked against torch."""
    q, cache, meta, expected = make_case(batch, context, dtype)
    scale = HEAD_DIM**-0.5
    torch_ops, cpu = TorchAttention(), cpu_attention.CpuAttention([cache])
    ref = torch_ops.attend(q, cache, meta, scale)
    err = (ref.float() - cpu.attend(q, cache, meta, scale).float()).abs().max().item()
    assert err < (1e-5 if dtype == torch.float32 else 3e-2), f"kernel differs by {err}"

    def tagged():
        meta.read_checks = allocate_read_checks(expected, meta.max_blocks, N_KV, False)
        cpu.attend(q, cache, meta, scale)
        meta.read_checks = None

    return [
        ("torch", median_ms(lambda: torch_ops.attend(q, cache, meta, scale), repeats)),
        ("cpu", median_ms(lambda: cpu.attend(q, cache, meta, scale), repeats)),
        ("cpu+tags", median_ms(tagged, repeats)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=["64x192", "1x256"], help="BATCHxCONTEXT")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    if cpu_attention.load_extension() is None:
        raise SystemExit(
            f"cpu attention extension unavailable: {cpu_attention.unavailable_reason()}"
        )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'case':>8} {'dtype':>9} {'backend':>9} {'ms/call':>9} {'vs torch':>9}")
    for case in args.cases:
        batch, context = (int(x) for x in case.split("x"))
        for name in args.dtypes:
            rows = time_case(batch, context, getattr(torch, name), args.repeats)
            base = rows[0][1]
            for backend, ms in rows:
                print(f"{case:>8} {name:>9} {backend:>9} {ms:9.3f} {base / ms:8.2f}x")


if __name__ == "__main__":
    main()
