"""Paged attention over a block-table KV cache, in plain torch.

Slot arithmetic (block_size = 4, block table of one sequence = [5, 2, 7]):

    logical token:  0 1 2 3 | 4 5 6 7 | 8 9
    block id:       5       | 2       | 7
    slot:          20..23   | 8..11   | 28 29      slot = block_id * block_size + offset

Each layer's cache is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (0 = K,
1 = V). Block 0 is reserved: padding entries of the block tables point at it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Everything one step's attention needs, shared by all layers.

    Invariant: sequence i owns the flat tokens [cu_q[i], cu_q[i] + query_lens[i]),
    and its keys are the context_lens[i] cached tokens followed by those new tokens.
    """

    slot_mapping: torch.Tensor  # (T,) int64 slot of each new token
    block_index: torch.Tensor  # (S * max_blocks,) int64 padded block tables, flat
    token_to_padded: torch.Tensor  # (T,) int64 index into the (S * Q) padded queries
    attn_mask: torch.Tensor  # (S, 1, Q, K) bool, True = may attend
    num_seqs: int
    max_query_len: int
    max_blocks: int
    block_size: int

    @staticmethod
    def build(
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Precompute the padded gather index and masks for one step."""
        num_seqs = len(query_lens)
        assert len(context_lens) == num_seqs == len(block_tables)
        assert len(slot_mapping) == sum(query_lens)
        max_q = max(query_lens)
        max_blocks = max(len(t) for t in block_tables)
        for q, c, t in zip(query_lens, context_lens, block_tables):
            assert len(t) * block_size >= q + c, "block table too short for its tokens"
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        block_index = torch.tensor(padded, dtype=torch.long).view(-1)  # (S * max_blocks,)
        q_lens = torch.tensor(query_lens, dtype=torch.long)  # (S,)
        ctx = torch.tensor(context_lens, dtype=torch.long)  # (S,)
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)  # (T,)
        starts = torch.cumsum(q_lens, 0) - q_lens  # (S,)
        offset = torch.arange(len(slot_mapping)) - starts[seq_of_token]  # (T,)
        token_to_padded = seq_of_token * max_q + offset  # (T,)
        kv_len = max_blocks * block_size
        j = torch.arange(max_q).view(1, max_q, 1)  # (1, Q, 1)
        k = torch.arange(kv_len).view(1, 1, kv_len)  # (1, 1, K)
        ctx3 = ctx.view(-1, 1, 1)  # (S, 1, 1)
        # Causal inside the chunk, full view of the cached prefix.
        mask = (k <= ctx3 + j) & (k < ctx3 + q_lens.view(-1, 1, 1))  # (S, Q, K)
        # Padded query rows see key 0 only, so softmax never meets an all-masked row.
        pad_rows = j >= q_lens.view(-1, 1, 1)  # (S, Q, 1)
        mask = mask | (pad_rows & (k == 0))
        return AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            block_index=block_index.to(device),
            token_to_padded=token_to_padded.to(device),
            attn_mask=mask.unsqueeze(1).to(device),  # (S, 1, Q, K)
            num_seqs=num_seqs,
            max_query_len=max_q,
            max_blocks=max_blocks,
            block_size=block_size,
        )


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V (T, n_kv_heads, head_dim) into `cache` at `slot_mapping` (T,)."""
    _, num_blocks, block_size, n_kv, head_dim = cache.shape
    flat = cache.view(2, num_blocks * block_size, n_kv, head_dim)  # (2, slots, n_kv, D)
    flat[0].index_copy_(0, slot_mapping, k.to(cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(cache.dtype))


def paged_attention(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention of new queries q (T, n_heads, D) over cached K/V; returns (T, n_heads, D)."""
    num_tokens, n_heads, head_dim = q.shape
    _, _, block_size, n_kv, _ = cache.shape
    s, qlen = meta.num_seqs, meta.max_query_len
    kv_len = meta.max_blocks * block_size
    kv = cache.index_select(1, meta.block_index)  # (2, S * max_blocks, block_size, n_kv, D)
    kv = kv.view(2, s, kv_len, n_kv, head_dim).permute(0, 1, 3, 2, 4)  # (2, S, n_kv, K, D)
    if n_heads != n_kv:
        kv = kv.repeat_interleave(n_heads // n_kv, dim=2)  # (2, S, n_heads, K, D)
    qp = q.new_zeros(s * qlen, n_heads, head_dim)  # (S * Q, n_heads, D)
    qp.index_copy_(0, meta.token_to_padded, q)
    qp = qp.view(s, qlen, n_heads, head_dim).transpose(1, 2)  # (S, n_heads, Q, D)
    out = F.scaled_dot_product_attention(
        qp, kv[0].to(q.dtype), kv[1].to(q.dtype), attn_mask=meta.attn_mask, scale=scale
    )  # (S, n_heads, Q, D)
    out = out.transpose(1, 2).reshape(s * qlen, n_heads, head_dim)  # (S * Q, n_heads, D)
    return out.index_select(0, meta.token_to_padded)  # (T, n_heads, D)
