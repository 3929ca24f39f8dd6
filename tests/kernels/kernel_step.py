"""A small paged cache with a step of mixed sequences, shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagewarden.kernels.attention import AttentionMetadata, write_kv


@dataclass
class Step:
    caches: list[torch.Tensor]  # per layer (2, num_blocks, bs, n_kv, D)
    meta: AttentionMetadata
    tables: list[list[int]]
    q: torch.Tensor  # (T, n_heads, D)
    slot_tags: torch.Tensor  # (num_blocks * bs,) int64
    expected_tags: torch.Tensor  # (S, kv_len) int64

    @property
    def block_tables(self) -> torch.Tensor:
        return self.meta.block_index.view(self.meta.num_seqs, self.meta.max_blocks)


def make_step(
    query_lens: list[int],
    context_lens: list[int],
    *,
    block_size: int = 16,
    num_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 16,
    num_layers: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> Step:
    """Random K/V for every cached position, each sequence on scattered blocks (block 0
    reserved), the step's new K/V written by the reference ``write_kv``."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens)]
    num_blocks = sum(need) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for n in need:
        tables.append(order[:n])
        order = order[n:]
    slot_of = [
        [t[p // block_size] * block_size + p % block_size for p in range(len(t) * block_size)]
        for t in tables
    ]
    slots = [
        slot_of[i][p]
        for i, (q, c) in enumerate(zip(query_lens, context_lens))
        for p in range(c, c + q)
    ]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, slots, block_size, device)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(num_layers)]
    total = sum(query_lens)
    slot_tags = torch.randint(-(2**62), 2**62, (num_blocks * block_size,), generator=gen).to(device)
    new_tags = torch.randint(-(2**62), 2**62, (total,), generator=gen).to(device)
    meta.slot_tags, meta.new_tags = slot_tags, new_tags
    for cache in caches:
        k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(device)
        v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(device)
        write_kv(cache, k, v, meta)
    expected = torch.zeros(len(tables), meta.kv_len, dtype=torch.int64)
    flat = slot_tags.cpu()
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        expected[i, : q + c] = flat[torch.tensor(slot_of[i][: q + c])]
    q = torch.randn(total, num_kv_heads * group, head_dim, generator=gen).to(dtype).to(device)
    return Step(caches, meta, tables, q, slot_tags, expected.to(device))
