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

Gathering whole blocks of S sequences (K and V together, once per layer and batch):

    cache (2, num_blocks, bs, n_kv, D) --index_select(dim 1, block index of the batch)-->
          (2, S * max_blocks, bs, n_kv, D) --view--> (2, S, max_blocks * bs, n_kv, D)
          --narrow to kv_len, permute--> K, V (S, n_kv, kv_len, D)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

# SDPA grew `enable_gqa` in torch 2.5; older versions get K/V repeated per query head.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class DecodeBatch:
    """Sequences with one new token each; their token i is decode sequence i."""

    token_index: torch.Tensor | None  # (S_d,) flat token of each; None: all T tokens, in order
    table_rows: torch.Tensor | None  # (S_d,) rows of the block tables; None: all rows
    max_blocks: int
    kv_len: int
    attn_mask: torch.Tensor | None  # (S_d, 1, 1, kv_len) bool, True = may attend


@dataclass
class FreshBatch:
    """Prompt chunks of `query_len` tokens each with no cached context (causal only)."""

    token_index: torch.Tensor | None  # (n * Q,) flat tokens, sequence-major; None: all T
    num_seqs: int
    query_len: int


@dataclass
class ChunkedBatch:
    """Chunks of more than one token over a cached prefix."""

    token_index: torch.Tensor | None  # (T_c,) flat tokens; None: all T tokens
    table_rows: torch.Tensor | None  # (S_c,) rows of the block tables; None: all rows
    token_to_padded: torch.Tensor | None  # (T_c,) into the (S_c * Q) padded queries
    attn_mask: torch.Tensor  # (S_c, 1, Q, kv_len) bool, True = may attend
    num_seqs: int
    max_query_len: int
    max_blocks: int
    kv_len: int


@dataclass
class ReadChecks:
    """Tensors of the checks an attention kernel runs on what it reads (fused backends).

    Invariant: ``tag_faults[i, lb]`` is nonzero iff some layer read a slot of sequence
    i's logical block lb whose tag differed from ``expected_tags[i, position]``;
    ``read_sums[i, h, lb]`` is the sum over layers of kv head h's share of that block's
    content checksum (complete for blocks inside the cached context).
    """

    expected_tags: torch.Tensor  # (S, kv_len) int64: tag of sequence i's position p
    tag_faults: torch.Tensor  # (S, max_blocks) int32, written by the kernel
    read_sums: torch.Tensor | None  # (S, n_kv, max_blocks) int64; None: no checksums

    def block_sums(self) -> torch.Tensor:
        """(S, max_blocks) int64: each read block's checksum (sum over kv heads, mod 2^64)."""
        assert self.read_sums is not None
        return self.read_sums.sum(dim=1)


@dataclass
class AttentionMetadata:
    """Everything one step's attention needs, built once and shared by all layers.

    Invariant: sequence i owns the flat tokens [cu_q[i], cu_q[i] + query_lens[i]),
    and its keys are the context_lens[i] cached tokens followed by those new tokens.

    Index contract: `slot_mapping` is the only index a kernel writes the cache with and
    `block_index` the only one it reads it with (the decode and chunked batches select
    their rows of it; fresh prompts read only their own new K/V). The integrity guard writes slot tags
    through the same `slot_mapping` tensor, in the same `write_kv` call, and checks them
    through this object's `block_index` after the forward pass, so a kernel that keeps
    to the contract is covered by construction. `slot_tags` (num_slots,) int64 is the
    guard's tag store and `new_tags` (T,) int64 the tag of each new token; both None
    when tags are off.
    """

    slot_mapping: torch.Tensor  # (T,) int64 slot of each new token
    block_index: torch.Tensor  # (S * max_blocks,) int64 padded block tables, flat
    num_seqs: int
    max_query_len: int
    max_blocks: int
    block_size: int
    kv_len: int
    decode: DecodeBatch | None = None
    fresh: list[FreshBatch] = field(default_factory=list)
    chunked: ChunkedBatch | None = None
    slot_tags: torch.Tensor | None = None  # (num_blocks * block_size,) int64, a view
    new_tags: torch.Tensor | None = None  # (T,) int64
    # (3, S) int32: first flat token, query length, context length of each sequence;
    # the query lengths also on the host (for kernels' launch grids).
    seq_info: torch.Tensor | None = None
    query_lens: list[int] = field(default_factory=list)
    # Set by the guard when the backend checks its reads itself (AttentionOps.fused_reads).
    read_checks: ReadChecks | None = None

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
        """Precompute the block index and the per-batch indices and masks for one step."""
        num_seqs = len(query_lens)
        assert len(context_lens) == num_seqs == len(block_tables)
        assert len(slot_mapping) == sum(query_lens)
        seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
        kv_len = max(seq_lens)
        max_blocks = -(-kv_len // block_size)
        for s, t in zip(seq_lens, block_tables):
            assert len(t) * block_size >= s, "block table too short for its tokens"
        # Only the blocks that hold keys are read; padding entries point at block 0.
        padded = [t[:max_blocks] + [0] * (max_blocks - len(t)) for t in block_tables]
        starts, decode, chunked = [0] * num_seqs, [], []
        fresh: dict[int, list[int]] = {}
        for i in range(num_seqs):
            starts[i] = starts[i - 1] + query_lens[i - 1] if i else 0
            if query_lens[i] == 1:
                decode.append(i)
            elif context_lens[i] == 0:
                fresh.setdefault(query_lens[i], []).append(i)
            else:
                chunked.append(i)
        plan = _StepPlan(query_lens, context_lens, starts, block_size, num_seqs, device)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            block_index=torch.tensor(padded, dtype=torch.long, device=device).view(-1),
            num_seqs=num_seqs,
            max_query_len=max(query_lens),
            max_blocks=max_blocks,
            block_size=block_size,
            kv_len=kv_len,
            decode=plan.decode(decode) if decode else None,
            fresh=[plan.fresh(seqs) for seqs in fresh.values()],
            chunked=plan.chunked(chunked) if chunked else None,
            seq_info=torch.tensor(
                [starts, query_lens, context_lens], dtype=torch.int32, device=device
            ),
            query_lens=list(query_lens),
        )


@dataclass
class _StepPlan:
    """Builds each batch's indices from the step's per-sequence lengths."""

    query_lens: list[int]
    context_lens: list[int]
    starts: list[int]  # first flat token of each sequence
    block_size: int
    num_seqs: int
    device: torch.device | str

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _tokens(self, seqs: list[int]) -> torch.Tensor | None:
        """Flat tokens of `seqs`, sequence-major; None when that is every token in order."""
        if len(seqs) == self.num_seqs:
            return None
        return self._tensor(
            [t for i in seqs for t in range(self.starts[i], self.starts[i] + self.query_lens[i])]
        )

    def _rows(self, seqs: list[int]) -> torch.Tensor | None:
        return None if len(seqs) == self.num_seqs else self._tensor(seqs)

    def decode(self, seqs: list[int]) -> DecodeBatch:
        lens = [self.context_lens[i] + 1 for i in seqs]
        kv_len = max(lens)
        mask = None
        if any(n != kv_len for n in lens):
            keys = torch.arange(kv_len).view(1, kv_len)  # (1, K)
            mask = (keys < torch.tensor(lens).view(-1, 1)).view(len(seqs), 1, 1, kv_len)
            mask = mask.to(self.device)
        return DecodeBatch(
            token_index=self._tokens(seqs),
            table_rows=self._rows(seqs),
            max_blocks=-(-kv_len // self.block_size),
            kv_len=kv_len,
            attn_mask=mask,
        )

    def fresh(self, seqs: list[int]) -> FreshBatch:
        return FreshBatch(self._tokens(seqs), len(seqs), self.query_lens[seqs[0]])

    def chunked(self, seqs: list[int]) -> ChunkedBatch:
        q_lens = [self.query_lens[i] for i in seqs]
        ctx = [self.context_lens[i] for i in seqs]
        max_q = max(q_lens)
        kv_len = max(q + c for q, c in zip(q_lens, ctx))
        token_to_padded = None
        if any(q != max_q for q in q_lens):
            token_to_padded = self._tensor(
                [n * max_q + j for n, q in enumerate(q_lens) for j in range(q)]
            )
        return ChunkedBatch(
            token_index=self._tokens(seqs),
            table_rows=self._rows(seqs),
            token_to_padded=token_to_padded,
            attn_mask=_attention_mask(q_lens, ctx, max_q, kv_len).to(self.device),
            num_seqs=len(seqs),
            max_query_len=max_q,
            max_blocks=-(-kv_len // self.block_size),
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


def _decode(q, cache, meta: AttentionMetadata, batch: DecodeBatch, scale: float) -> torch.Tensor:
    """(S_d, n_heads, D) attention of the decode tokens (module docstring)."""
    qd = _rows_of(q, batch.token_index)  # (S_d, n_heads, D)
    s, n_heads, head_dim = qd.shape
    n_kv = cache.shape[3]
    index = batch_block_index(meta, batch.table_rows, batch.max_blocks)
    k, v = gather_kv(cache, index, s, batch.kv_len)  # (S_d, n_kv, K, D)
    # A wider q is cast down to the cache's dtype: far fewer bytes than K/V cast up.
    qf = qd.view(s, n_kv, n_heads // n_kv, head_dim).to(cache.dtype)  # (S_d, n_kv, G, D)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=batch.attn_mask, scale=scale)
    return out.view(s, n_heads, head_dim).to(q.dtype)


def _sdpa_gqa(q, k, v, scale: float, mask=None, causal: bool = False) -> torch.Tensor:
    """SDPA of q (S, n_heads, Q, D) over k, v (S, n_kv, K, D)."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and not _SDPA_HAS_GQA:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    gqa = {"enable_gqa": True} if group > 1 and _SDPA_HAS_GQA else {}
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **gqa
    )


def _fresh(q, k, v, cache_dtype, batch: FreshBatch, scale: float) -> torch.Tensor:
    """(n * Q, n_heads, D) causal attention of fresh prompt tokens over their own K/V."""
    n, qlen = batch.num_seqs, batch.query_len
    qf, kf, vf = (_rows_of(x, batch.token_index) for x in (q, k, v))  # (n * Q, heads, D)
    if cache_dtype != q.dtype:  # see exactly what a later read of the cache returns
        kf, vf = kf.to(cache_dtype).to(q.dtype), vf.to(cache_dtype).to(q.dtype)
    qh, kh, vh = (x.view(n, qlen, x.shape[1], x.shape[2]).transpose(1, 2) for x in (qf, kf, vf))
    out = _sdpa_gqa(qh, kh, vh, scale, causal=True)  # (n, n_heads, Q, D)
    return out.transpose(1, 2).reshape(n * qlen, q.shape[1], q.shape[2])


def _chunked(q, cache, meta: AttentionMetadata, batch: ChunkedBatch, scale: float) -> torch.Tensor:
    """(T_c, n_heads, D) attention of chunks over their cached prefix and themselves."""
    qc = _rows_of(q, batch.token_index)  # (T_c, n_heads, D)
    _, n_heads, head_dim = qc.shape
    s, qlen = batch.num_seqs, batch.max_query_len
    index = batch_block_index(meta, batch.table_rows, batch.max_blocks)
    k, v = gather_kv(cache, index, s, batch.kv_len)  # (S_c, n_kv, K, D)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if batch.token_to_padded is not None:
        qp = qc.new_zeros(s * qlen, n_heads, head_dim)  # (S_c * Q, n_heads, D)
        qp.index_copy_(0, batch.token_to_padded, qc)
    else:
        qp = qc  # already (S_c * Q, n_heads, D)
    qh = qp.view(s, qlen, n_heads, head_dim).transpose(1, 2)  # (S_c, n_heads, Q, D)
    out = _sdpa_gqa(qh, k, v, scale, mask=batch.attn_mask)  # (S_c, n_heads, Q, D)
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
    `sliding_window` W: a query at position p sees keys p - W < j <= p; `softcap` c:
    scaled scores become c * tanh(s / c) before the mask (both: `masked_attention`).
    """
    if sliding_window is not None or softcap is not None:
        return masked_attention(q, cache, meta, scale, sliding_window, softcap)
    parts: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    if meta.decode is not None:
        parts.append((meta.decode.token_index, _decode(q, cache, meta, meta.decode, scale)))
    if meta.fresh and new_kv is None:
        new_kv = read_new_kv(cache, meta.slot_mapping)
    for batch in meta.fresh:
        k, v = new_kv  # type: ignore[misc]
        parts.append((batch.token_index, _fresh(q, k, v, cache.dtype, batch, scale)))
    if meta.chunked is not None:
        parts.append((meta.chunked.token_index, _chunked(q, cache, meta, meta.chunked, scale)))
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    out = torch.empty_like(q)  # (T, n_heads, D)
    for index, part in parts:
        assert index is not None
        out.index_copy_(0, index, part)
    return out


def masked_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """(T, n_heads, D) attention of every new token through `meta.block_index` with an
    explicit mask: causal, keys p - sliding_window < j <= p (all j <= p when None), and
    scores soft-capped to softcap * tanh(s / softcap) before the mask; softmax in float32.

    Every row reads the K/V written to the cache (the step's own too), in queries padded
    per sequence to the step's longest: q (S * Q, n_heads, D) -> (S, n_kv, G, Q, D).
    """
    t, n_heads, head_dim = q.shape
    s, qlen, kv_len = meta.num_seqs, meta.max_query_len, meta.kv_len
    assert meta.seq_info is not None
    starts, q_lens, ctx = meta.seq_info.long().unbind(0)  # (S,) each
    k, v = gather_kv(cache, meta.block_index, s, kv_len)  # (S, n_kv, K, D)
    n_kv = k.shape[1]
    row = torch.repeat_interleave(torch.arange(s, device=q.device), q_lens, output_size=t)
    padded = row * qlen + torch.arange(t, device=q.device) - starts[row]  # (T,)
    qp = q.new_zeros(s * qlen, n_heads, head_dim).index_copy_(0, padded, q)
    qh = qp.view(s, qlen, n_kv, n_heads // n_kv, head_dim).permute(0, 2, 3, 1, 4)
    scores = qh @ k.to(q.dtype).unsqueeze(2).transpose(-1, -2) * scale  # (S, n_kv, G, Q, K)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = ctx.view(s, 1, 1) + torch.arange(qlen, device=q.device).view(1, qlen, 1)  # (S, Q, 1)
    keys = torch.arange(kv_len, device=q.device).view(1, 1, kv_len)  # (1, 1, K)
    mask = keys <= pos  # (S, Q, K)
    if sliding_window is not None:
        mask &= keys > pos - sliding_window
    # Padded query rows see key 0 only, so softmax never meets an all-masked row.
    mask |= (torch.arange(qlen, device=q.device).view(1, qlen, 1) >= q_lens.view(s, 1, 1)) & (
        keys == 0
    )
    scores = scores.masked_fill(~mask.view(s, 1, 1, qlen, kv_len), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = probs @ v.to(q.dtype).unsqueeze(2)  # (S, n_kv, G, Q, D)
    out = out.permute(0, 3, 1, 2, 4).reshape(s * qlen, n_heads, head_dim)
    return out.index_select(0, padded)  # (T, n_heads, D)


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
    ) -> torch.Tensor: ...


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
