"""Paged attention over a block-table KV cache, in plain torch.

Slot arithmetic (block_size = 4, block table of one sequence = [5, 2, 7]):

    logical token:  0 1 2 3 | 4 5 6 7 | 8 9
    block id:       5       | 2       | 7
    slot:          20..23   | 8..11   | 28 29      slot = block_id * block_size + offset

Each layer's cache is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (0 = K,
1 = V). Block 0 is reserved: padding entries of the block tables point at it.

`AttentionMetadata.block_index` is the one index attention reads the cache through: the
step's padded block tables, flat. Each step's sequences are split into three batches,
each computed by the cheapest kernel that is exact for it:

    decode   one new token, any cached context: K/V gathered through block_index
             (rows of the decode sequences), one SDPA call; the G = n_heads / n_kv
             query heads of a kv head are folded into its query rows (a free view), so
             K/V are never repeated per query head:
                 q (S, n_heads, D) --view--> (S, n_kv, G, D)   over K, V (S, n_kv, K, D)
             a mask (S, 1, 1, K) only when the sequences' lengths differ.
    fresh    a prompt (chunk) with no cached context, grouped by length: causal SDPA
             on the step's own K/V (rounded to the cache dtype, so a token sees exactly
             the K/V a later read of the cache returns); no gather, no mask.
    chunked  a chunk over a cached prefix: K/V gathered through block_index, queries
             padded to the longest chunk of this batch only, an explicit mask.

A layer with a sliding window of W keys (``sliding_window``; query at position p sees
keys j with p - W < j <= p) gathers only the blocks of its windows: the decode and
chunked batches read through ``meta.windowed(batch, W)`` (the block ids from each row's
first window block, and the mask in absolute positions, built once per step), fresh
prompts use a band mask. ``softcap`` c caps the scaled logits to c * tanh(logits / c)
(``softcapped_attention``, float32). See docs/attention.md.

Gathering whole blocks of S sequences (K and V together, once per layer and batch):

    cache (2, num_blocks, bs, n_kv, D) --index_select(dim 1, block index of the batch)-->
          (2, S * max_blocks, bs, n_kv, D) --view--> (2, S, max_blocks * bs, n_kv, D)
          --narrow to kv_len, permute--> K, V (S, n_kv, kv_len, D)
"""

from __future__ import annotations

import operator
from typing import Protocol

import torch
import torch.nn.functional as F

from pagewarden.kernels.attention_metadata import (
    AttentionMetadata,
    ChunkedBatch,
    DecodeBatch,
    FreshBatch,
    ReadChecks,
    WindowedRead,
)

__all__ = [
    "AttentionMetadata",
    "AttentionOps",
    "ChunkedBatch",
    "DecodeBatch",
    "FreshBatch",
    "ReadChecks",
    "TorchAttention",
    "WindowedRead",
    "paged_attention",
    "read_new_kv",
    "write_kv",
]

# SDPA grew `enable_gqa` in torch 2.5; older versions get K/V repeated per query head.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


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


def batch_block_index(
    meta: AttentionMetadata, rows: torch.Tensor | None, max_blocks: int
) -> torch.Tensor:
    """(S_b * max_blocks,) the rows of `meta.block_index` one batch reads, flat."""
    if rows is None and max_blocks == meta.max_blocks:
        return meta.block_index
    tables = meta.block_index.view(meta.num_seqs, meta.max_blocks)  # (S, max_blocks)
    if rows is not None:
        tables = tables.index_select(0, rows)  # (S_b, max_blocks)
    return tables[:, :max_blocks].reshape(-1)


def gather_kv(
    cache: torch.Tensor, block_index: torch.Tensor, num_seqs: int, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (S, n_kv, kv_len, D) of `num_seqs` sequences read through `block_index`."""
    _, _, block_size, n_kv, head_dim = cache.shape
    kv = cache.index_select(1, block_index)  # (2, S * max_blocks, bs, n_kv, D)
    kv = kv.view(2, num_seqs, -1, n_kv, head_dim)  # (2, S, max_blocks * bs, n_kv, D)
    kv = kv[:, :, :kv_len].permute(0, 1, 3, 2, 4)  # (2, S, n_kv, kv_len, D)
    return kv[0], kv[1]


def _rows_of(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


def _decode(
    q, cache, meta: AttentionMetadata, batch: DecodeBatch, scale: float, window, softcap
) -> torch.Tensor:
    """(S_d, n_heads, D) attention of the decode tokens (module docstring)."""
    qd = _rows_of(q, batch.token_index)  # (S_d, n_heads, D)
    s, n_heads, head_dim = qd.shape
    n_kv = cache.shape[3]
    if window is None:
        index = batch_block_index(meta, batch.table_rows, batch.max_blocks)
        kv_len, mask = batch.kv_len, batch.attn_mask
    else:  # only the blocks of each window (meta.windowed)
        read = meta.windowed("decode", window)
        index, kv_len, mask = read.block_index, read.num_blocks * meta.block_size, read.attn_mask
    k, v = gather_kv(cache, index, s, kv_len)  # (S_d, n_kv, K, D)
    # A wider q is cast down to the cache's dtype: far fewer bytes than K/V cast up.
    qf = qd.view(s, n_kv, n_heads // n_kv, head_dim).to(cache.dtype)  # (S_d, n_kv, G, D)
    if softcap is None:
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)
    else:
        out = softcapped_attention(qf, k, v, scale, softcap, mask)
    return out.reshape(s, n_heads, head_dim).to(q.dtype)


def _sdpa_gqa(q, k, v, scale: float, mask=None, causal: bool = False) -> torch.Tensor:
    """SDPA of q (S, n_heads, Q, D) over k, v (S, n_kv, K, D)."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and not _SDPA_HAS_GQA:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    gqa = {"enable_gqa": True} if group > 1 and _SDPA_HAS_GQA else {}
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **gqa
    )


def softcapped_attention(q, k, v, scale: float, softcap: float, mask=None) -> torch.Tensor:
    """Attention of q (S, n_heads, Q, D) over k, v (S, n_kv, K, D) with logits
    ``softcap * tanh(scale * q.k / softcap)`` (Gemma 2), in float32; mask (S or 1, 1, Q,
    K) bool, True = may attend. Returns (S, n_heads, Q, D) in q's dtype."""
    s, n_heads, qlen, head_dim = q.shape
    n_kv, group = k.shape[1], n_heads // k.shape[1]
    # The G query heads of a kv head as G * Q rows over its keys: K/V never repeated.
    qg = q.float().reshape(s, n_kv, group * qlen, head_dim)  # (S, n_kv, G * Q, D)
    scores = qg @ k.float().transpose(-1, -2) * scale  # (S, n_kv, G * Q, K)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        n, keys = mask.shape[0], mask.shape[-1]
        m = mask.unsqueeze(2).expand(n, 1, group, qlen, keys)  # (S, 1, G, Q, K)
        scores = scores.masked_fill(~m.reshape(n, 1, group * qlen, keys), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.float()  # (S, n_kv, G * Q, D)
    return out.view(s, n_heads, qlen, head_dim).to(q.dtype)


def _band_mask(qlen: int, window: int, device) -> torch.Tensor:
    """(1, 1, Q, Q) bool: query i sees keys j with i - window < j <= i."""
    i = torch.arange(qlen, device=device).view(-1, 1)
    j = torch.arange(qlen, device=device).view(1, -1)
    return ((j <= i) & (j > i - window)).view(1, 1, qlen, qlen)


def _fresh(
    q, k, v, cache_dtype, batch: FreshBatch, scale: float, window=None, softcap=None
) -> torch.Tensor:
    """(n * Q, n_heads, D) causal attention of fresh prompt tokens over their own K/V."""
    n, qlen = batch.num_seqs, batch.query_len
    qf, kf, vf = (_rows_of(x, batch.token_index) for x in (q, k, v))  # (n * Q, heads, D)
    if cache_dtype != q.dtype:  # see exactly what a later read of the cache returns
        kf, vf = kf.to(cache_dtype).to(q.dtype), vf.to(cache_dtype).to(q.dtype)
    qh, kh, vh = (x.view(n, qlen, x.shape[1], x.shape[2]).transpose(1, 2) for x in (qf, kf, vf))
    if window is not None and window >= qlen:
        window = None  # every key of the prompt is inside every query's window
    if window is None and softcap is None:
        out = _sdpa_gqa(qh, kh, vh, scale, causal=True)  # (n, n_heads, Q, D)
    else:
        mask = _band_mask(qlen, window or qlen, q.device)
        if softcap is None:
            out = _sdpa_gqa(qh, kh, vh, scale, mask=mask)
        else:
            out = softcapped_attention(qh, kh, vh, scale, softcap, mask)
    return out.transpose(1, 2).reshape(n * qlen, q.shape[1], q.shape[2])


def _chunked(
    q, cache, meta: AttentionMetadata, batch: ChunkedBatch, scale: float, window=None, softcap=None
) -> torch.Tensor:
    """(T_c, n_heads, D) attention of chunks over their cached prefix and themselves."""
    qc = _rows_of(q, batch.token_index)  # (T_c, n_heads, D)
    _, n_heads, head_dim = qc.shape
    s, qlen = batch.num_seqs, batch.max_query_len
    if window is None:
        index = batch_block_index(meta, batch.table_rows, batch.max_blocks)
        kv_len, mask = batch.kv_len, batch.attn_mask
    else:  # only the blocks of each chunk's windows (meta.windowed)
        read = meta.windowed("chunked", window)
        index, kv_len, mask = read.block_index, read.num_blocks * meta.block_size, read.attn_mask
    k, v = gather_kv(cache, index, s, kv_len)  # (S_c, n_kv, K, D)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if batch.token_to_padded is not None:
        qp = qc.new_zeros(s * qlen, n_heads, head_dim)  # (S_c * Q, n_heads, D)
        qp.index_copy_(0, batch.token_to_padded, qc)
    else:
        qp = qc  # already (S_c * Q, n_heads, D)
    qh = qp.view(s, qlen, n_heads, head_dim).transpose(1, 2)  # (S_c, n_heads, Q, D)
    if softcap is None:
        out = _sdpa_gqa(qh, k, v, scale, mask=mask)  # (S_c, n_heads, Q, D)
    else:
        out = softcapped_attention(qh, k, v, scale, softcap, mask)
    out = out.transpose(1, 2).reshape(s * qlen, n_heads, head_dim)  # (S_c * Q, n_heads, D)
    return _rows_of(out, batch.token_to_padded)  # (T_c, n_heads, D)


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of new queries q (T, n_heads, D) over cached K/V; returns (T, n_heads, D).

    `new_kv` is the step's own K/V (T, n_kv, D), already written to the cache; fresh
    prompts attend to it directly. Without it they are read back from the cache.
    `sliding_window` W: a query at position p sees keys j with p - W < j <= p, and only
    the blocks holding them are read; `softcap` c: logits c * tanh(logits / c) before
    the mask and softmax. None: off.
    """
    w, c = check_window_args(sliding_window, softcap)
    parts: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    if meta.decode is not None:
        parts.append((meta.decode.token_index, _decode(q, cache, meta, meta.decode, scale, w, c)))
    if meta.fresh and new_kv is None:
        new_kv = read_new_kv(cache, meta.slot_mapping)
    for batch in meta.fresh:
        k, v = new_kv  # type: ignore[misc]
        parts.append((batch.token_index, _fresh(q, k, v, cache.dtype, batch, scale, w, c)))
    if meta.chunked is not None:
        chunked = _chunked(q, cache, meta, meta.chunked, scale, w, c)
        parts.append((meta.chunked.token_index, chunked))
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    out = torch.empty_like(q)  # (T, n_heads, D)
    for index, part in parts:
        assert index is not None
        out.index_copy_(0, index, part)
    return out


class AttentionBackendError(ValueError):
    """The requested attention backend cannot run on this device; the message says why."""


def check_window_args(
    sliding_window: int | None, softcap: float | None
) -> tuple[int | None, float | None]:
    """The window as a positive int and the cap as a positive finite float (None: off),
    from any integer / real type a config holds; ValueError otherwise."""
    window: int | None = None
    cap: float | None = None
    if sliding_window is not None:
        try:
            window = operator.index(sliding_window)
        except TypeError:
            window = 0
        if isinstance(sliding_window, bool) or window < 1:
            raise ValueError(
                f"sliding_window must be a positive int or None, got {sliding_window!r}"
            )
    if softcap is not None:
        cap = float(softcap)
        if not 0 < cap < float("inf"):
            raise ValueError(f"softcap must be a positive finite float or None, got {softcap!r}")
    return window, cap


class AttentionOps(Protocol):
    """How a model layer writes and reads its cache; the worker picks the backend."""

    #: True when ``attend`` runs ``meta.read_checks`` itself as it reads the cache.
    fused_reads: bool

    def write_kv(
        self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None: ...

    def attend(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention (T, n_heads, D) of the step's queries over the paged cache: a query
        at position p sees keys j with p - sliding_window < j <= p (all j <= p when None),
        reading only the blocks that hold them; logits are capped to
        ``softcap * tanh(logits / softcap)`` before masking and softmax (None: not)."""
        ...


class TorchAttention:
    """The plain-torch backend: ``write_kv`` and ``paged_attention`` of this module."""

    fused_reads = False

    def write_kv(
        self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        write_kv(cache, k, v, meta)

    def attend(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return paged_attention(
            q, cache, meta, scale, new_kv, sliding_window=sliding_window, softcap=softcap
        )


def read_new_kv(
    cache: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V (T, n_kv, D) stored at `slot_mapping` (the step's own tokens)."""
    _, num_blocks, block_size, n_kv, head_dim = cache.shape
    flat = cache.view(2, num_blocks * block_size, n_kv, head_dim)  # (2, slots, n_kv, D)
    kv = flat.index_select(1, slot_mapping)  # (2, T, n_kv, D)
    return kv[0], kv[1]
