"""Decode attention of the cpu backend's kernel alone, against the bytes it must read.

One decode step's attention for the default model's shapes (30 layers, 3 kv heads x 3
query heads, head dim 64, block size 16): a batch of sequences with contexts drawn from
[128, 256) (the 64 x 128/128 workload's middle), blocks scattered over the cache, K/V in
bfloat16 (or float32). It prints the median step time and the time the K/V bytes take at
``--bandwidth`` GB/s, so a kernel change shows how far it is from the memory floor.
``--hot`` points every table at the same 8 blocks, which then stay in cache: the time
left is the kernel's arithmetic.

    python bench/attention_kernel.py                    # batch 64, bf16
    python bench/attention_kernel.py --batch 1 --hot
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from pagewarden.kernels.cpu import attention as cpu_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hot", action="store_true", help="every table reads the same 8 blocks")
    ap.add_argument("--bandwidth", type=float, default=14.5, help="GB/s, for the floor")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    ext = cpu_attention.load_extension()
    if ext is None:
        raise SystemExit(f"the kernel does not build here: {cpu_attention.unavailable_reason()}")
    torch.manual_seed(0)
    s, bs, n_kv, group, d = args.batch, 16, 3, 3, 64
    dtype = getattr(torch, args.dtype)
    ctx = torch.randint(128, 256, (s,))
    max_blocks = int(-(-(int(ctx.max()) + 1) // bs))
    num_blocks = s * max_blocks + 1
    caches = [torch.randn(2, num_blocks, bs, n_kv, d).to(dtype) for _ in range(args.layers)]
    if args.hot:
        tables = torch.arange(s * max_blocks) % 8 + 1
    else:
        tables = torch.randperm(num_blocks - 1)[: s * max_blocks] + 1
    tables = tables.view(s, max_blocks).contiguous()
    q = torch.randn(s, n_kv * group, d).to(dtype)
    info = torch.stack([torch.arange(s), torch.ones(s, dtype=torch.long), ctx]).int()
    rows = torch.arange(s)
    out = torch.empty_like(q)
    splits = cpu_attention.choose_num_splits(s, max_blocks)

    def step() -> float:
        t0 = time.perf_counter()
        for cache in caches:
            ext.decode_attention(
                q, cache, tables, info.contiguous(), rows, 0.125, out, *[None] * 6, splits
            )
        return time.perf_counter() - t0

    step(), step()
    ms = statistics.median(step() for _ in range(args.repeats)) * 1e3
    kv_bytes = args.layers * int((ctx + 1).sum()) * n_kv * d * 2 * caches[0].element_size()
    floor = kv_bytes / (args.bandwidth * 1e9) * 1e3
    print(f"uptime: {os.popen('uptime').read().strip()}")
    print(
        f"batch {s}, {args.dtype}, {'hot' if args.hot else 'scattered'} blocks, "
        f"{torch.get_num_threads()} threads, {splits} split(s): attention {ms:.1f} ms a step; "
        f"K/V {kv_bytes / 1e6:.0f} MB = {floor:.1f} ms at {args.bandwidth} GB/s"
    )


if __name__ == "__main__":
    main()
