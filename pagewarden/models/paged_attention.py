"""Paged attention over a block-table KV cache, in plain torch.

Slot arithmetic (block_size = 4, block table of one sequence = [5, 2, 7]):

    logical token:  0 1 2 3 | 4 5 6 7 | 8 9
    block id:       5       | 2       | 7
    slot:          20..23   | 8..11   | 28 29      slot = block_id * block_size + offset

Each layer's cache is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (0 = K,
1 = V). Block 0 is reserved: padding entries of the block tables point at it.

Reads gather whole blocks by the padded block tables, once per layer, K and V together:

    cache (2, num_blocks, bs, n_kv, D) --index_select(dim 1, block_index)-->
          (2, S * max_blocks, bs, n_kv, D) --view--> (2, S, max_blocks * bs, n_kv, D)
          --narrow to kv_len, permute--> K, V (S, n_kv, kv_len, D)

Grouped-query attention without copying K/V per query head. In a decode step (one new
token per sequence) the G = n_heads / n_kv query heads that share a kv head (heads
kv * G .. kv * G + G - 1, the `repeat_interleave` convention) are folded into that kv
head's query rows, a free view:

    q (T = S, n_heads, D) --view--> (S, n_kv, G, D)        SDPA over K, V (S, n_kv, K, D)
    mask (S, 1, 1, K) broadcasts over the G rows

Steps with longer queries pad them to (S, n_heads, Q, D) and use SDPA's `enable_gqa`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# SDPA grew `enable_gqa` in torch 2.5; older versions get K/V repeated per query head.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class AttentionMetadata:
    """Everything one step's attention needs, built once and shared by all layers.

    Invariant: sequence i owns the flat tokens [cu_q[i], cu_q[i] + query_lens[i]),
    and its keys are the context_lens[i] cached tokens followed by those new tokens.
    `kv_len` is the longest of those key ranges; keys past a sequence's own range are
    masked out by `attn_mask`, which is None when no key and no query row is padding.

    Index contract: `slot_mapping` is the only index a kernel writes the cache with and
    `block_index` the only one it reads it with. The integrity guard writes slot tags
    through the same `slot_mapping` tensor, in the same `write_kv` call, and checks them
    through this object's `block_index` after the forward pass, so a kernel that keeps
    to the contract is covered by construction. `slot_tags` (num_slots,) int64 is the
    guard's tag store and `new_tags` (T,) int64 the tag of each new token; both None
    when tags are off.
    """

    slot_mapping: torch.Tensor  # (T,) int64 slot of each new token
    block_index: torch.Tensor  # (S * max_blocks,) int64 padded block tables, flat
    token_to_padded: (
        torch.Tensor | None
    )  # (T,) int64 index into the (S * Q) padded queries; None when T == S * Q
    attn_mask: torch.Tensor | None  # (S, 1, Q, kv_len) bool, True = may attend; None = all allowed
    num_seqs: int
    max_query_len: int
    max_blocks: int
    block_size: int
    kv_len: int
    slot_tags: torch.Tensor | None = None  # (num_blocks * block_size,) int64, a view
    new_tags: torch.Tensor | None = None  # (T,) int64

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token."""
        return self.max_query_len == 1

    @staticmethod
    def build(
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Precompute the padded gather index and masks for one step."""
        num_seqs = len(query_lens)
        assert len(context_lens) == num_seqs == len(block_tables)
        assert len(slot_mapping) == sum(query_lens)
        max_q = max(query_lens)
        seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
        kv_len = max(seq_lens)
        max_blocks = -(-kv_len // block_size)
        for s, t in zip(seq_lens, block_tables):
            assert len(t) * block_size >= s, "block table too short for its tokens"
        # Only the blocks that hold keys are read; padding entries point at block 0.
        padded = [t[:max_blocks] + [0] * (max_blocks - len(t)) for t in block_tables]
        block_index = torch.tensor(padded, dtype=torch.long).view(-1)  # (S * max_blocks,)
        uniform_q = all(q == max_q for q in query_lens)
        token_to_padded = None
        if not uniform_q:
            q_lens = torch.tensor(query_lens, dtype=torch.long)  # (S,)
            seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)  # (T,)
            starts = torch.cumsum(q_lens, 0) - q_lens  # (S,)
            offset = torch.arange(len(slot_mapping)) - starts[seq_of_token]  # (T,)
            token_to_padded = (seq_of_token * max_q + offset).to(device)  # (T,)
        mask = None
        if max_q > 1 or any(s != kv_len for s in seq_lens):
            mask = _attention_mask(query_lens, context_lens, max_q, kv_len).to(device)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            block_index=block_index.to(device),
            token_to_padded=token_to_padded,
            attn_mask=mask,
            num_seqs=num_seqs,
            max_query_len=max_q,
            max_blocks=max_blocks,
            block_size=block_size,
            kv_len=kv_len,
        )


def _attention_mask(
    query_lens: list[int], context_lens: list[int], max_q: int, kv_len: int
) -> torch.Tensor:
    """(S, 1, Q, K) bool: causal inside each chunk, full view of its cached prefix."""
    q_lens = torch.tensor(query_lens, dtype=torch.long).view(-1, 1, 1)  # (S, 1, 1)
    ctx = torch.tensor(context_lens, dtype=torch.long).view(-1, 1, 1)  # (S, 1, 1)
    j = torch.arange(max_q).view(1, max_q, 1)  # (1, Q, 1)
    k = torch.arange(kv_len).view(1, 1, kv_len)  # (1, 1, K)
    mask = (k <= ctx + j) & (k < ctx + q_lens)  # (S, Q, K)
    # Padded query rows see key 0 only, so softmax never meets an all-masked row.
    mask = mask | ((j >= q_lens) & (k == 0))
    return mask.unsqueeze(1)  # (S, 1, Q, K)


def write_kv(
    cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Scatter new K/V (T, n_kv_heads, head_dim) into `cache` at `meta.slot_mapping` (T,),
    and the new tokens' slot tags (when on) through the very same index tensor."""
    _, num_blocks, block_size, n_kv, head_dim = cache.shape
    slot_mapping = meta.slot_mapping
    flat = cache.view(2, num_blocks * block_size, n_kv, head_dim)  # (2, slots, n_kv, D)
    flat[0].index_copy_(0, slot_mapping, k.to(cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(cache.dtype))
    if meta.new_tags is not None:  # (same value in every layer's call: idempotent)
        meta.slot_tags.index_copy_(0, slot_mapping, meta.new_tags)


def gather_kv(cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (S, n_kv, kv_len, D) of every sequence, read through its block table."""
    _, _, block_size, n_kv, head_dim = cache.shape
    kv = cache.index_select(1, meta.block_index)  # (2, S * max_blocks, bs, n_kv, D)
    kv = kv.view(2, meta.num_seqs, meta.max_blocks * block_size, n_kv, head_dim)
    kv = kv[:, :, : meta.kv_len].permute(0, 1, 3, 2, 4)  # (2, S, n_kv, kv_len, D)
    return kv[0], kv[1]


def paged_attention(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention of new queries q (T, n_heads, D) over cached K/V; returns (T, n_heads, D)."""
    num_tokens, n_heads, head_dim = q.shape
    n_kv = cache.shape[3]
    group = n_heads // n_kv
    s, qlen = meta.num_seqs, meta.max_query_len
    k, v = gather_kv(cache, meta)  # (S, n_kv, K, D)
    if qlen == 1:
        # Decode: fold each kv head's G query heads into its query rows (module docstring).
        # A wider q is cast down to the cache's dtype: far fewer bytes than K/V cast up.
        qf = q.view(s, n_kv, group, head_dim).to(cache.dtype)  # (S, n_kv, G, D)
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=meta.attn_mask, scale=scale)
        return out.view(num_tokens, n_heads, head_dim).to(q.dtype)  # (T, n_heads, D); T == S
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if meta.token_to_padded is not None:
        qp = q.new_zeros(s * qlen, n_heads, head_dim)  # (S * Q, n_heads, D)
        qp.index_copy_(0, meta.token_to_padded, q)
    else:
        qp = q  # already (S * Q, n_heads, D)
    qh = qp.view(s, qlen, n_heads, head_dim).transpose(1, 2)  # (S, n_heads, Q, D)
    if group > 1 and not _SDPA_HAS_GQA:
        k, v = (
            k.repeat_interleave(group, dim=1),
            v.repeat_interleave(group, dim=1),
        )  # (S, n_heads, K, D)
    gqa = {"enable_gqa": True} if group > 1 and _SDPA_HAS_GQA else {}
    out = F.scaled_dot_product_attention(
        qh, k, v, attn_mask=meta.attn_mask, scale=scale, **gqa
    )  # (S, n_heads, Q, D)
    out = out.transpose(1, 2).reshape(s * qlen, n_heads, head_dim)  # (S * Q, n_heads, D)
    if meta.token_to_padded is not None:
        out = out.index_select(0, meta.token_to_padded)
    return out  # (T, n_heads, D)
