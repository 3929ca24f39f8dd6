"""One step's attention metadata: the block index every layer reads through, the step's
split into decode, fresh and chunked batches, and the read checks of fused backends.

Built once per step by ``AttentionMetadata.build`` and shared by all layers. A
sliding-window layer reads fewer blocks than a global one; ``AttentionMetadata.windowed``
builds (once per step, window and batch) the block index and mask of that smaller read:

    window W = 6, block_size 4, a chunk of 2 queries at positions 21, 22 (context 21)

    position:       0..3 | 4..7 | 8..11 | 12..15 | 16..19 | 20..23
    logical block:  0    | 1    | 2     | 3      | 4      | 5
    query 21 sees keys 16..21, query 22 sees 17..22: the read starts at block 4
    (first_block = (21 - 6 + 1) // 4 = 4) and covers blocks 4, 5; keys 16..19 of block 4
    that a query's window excludes are masked, blocks 0..3 are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
class WindowedRead:
    """What one batch of a sliding-window layer reads: only the blocks that hold some
    query's window (module docstring), and which of their keys each query may see.

    Row i reads logical blocks ``first_block[i] + j`` for j < ``num_blocks``; gathered
    key k of row i is position ``first_block[i] * block_size + k``.
    """

    block_index: torch.Tensor  # (S_b * num_blocks,) int64 block ids, row-major
    first_block: list[int]  # (S_b,) first logical block each row reads
    num_blocks: int
    attn_mask: torch.Tensor  # (S_b, 1, Q, num_blocks * block_size) bool, True = may attend
    source: torch.Tensor  # the meta.block_index it was taken from


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
    # (S, max_blocks) int32: how many layers added their share to read_sums[i, :, lb]
    # (a sliding-window layer skips the blocks before its window); None with read_sums.
    read_layers: torch.Tensor | None = None

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
    context_lens: list[int] = field(default_factory=list)
    # Set by the guard when the backend checks its reads itself (AttentionOps.fused_reads).
    read_checks: ReadChecks | None = None
    # (batch, window) -> that batch's read by a sliding-window layer (``windowed``).
    _windowed: dict[tuple[str, int], WindowedRead] = field(default_factory=dict, repr=False)

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
            context_lens=list(context_lens),
        )

    def windowed(self, batch: str, window: int) -> WindowedRead:
        """The read of the ``decode`` or ``chunked`` batch by a layer with a sliding window
        of ``window`` keys, built from ``block_index`` on the first call of the step."""
        key = (batch, window)
        read = self._windowed.get(key)
        # Built from the block_index this forward call reads with (a fault injector may
        # swap the tensor between build and forward).
        if read is None or read.source is not self.block_index:
            seqs = [
                i
                for i, (q, c) in enumerate(zip(self.query_lens, self.context_lens))
                if (q == 1) == (batch == "decode") and (q == 1 or c > 0)
            ]
            read = windowed_read(self, seqs, window)
            self._windowed[key] = read
        return read


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


def window_start(context_len: int, window: int) -> int:
    """First position any query of a sequence with ``context_len`` cached tokens may see
    (its first query sits at position ``context_len`` and sees ``window`` keys)."""
    return max(0, context_len - window + 1)


def windowed_read(meta: AttentionMetadata, seqs: list[int], window: int) -> WindowedRead:
    """The blocks and mask of ``seqs`` (all decodes or all chunks) read with a window of
    ``window`` keys: query at position p sees keys j with p - window < j <= p."""
    bs = meta.block_size
    ctx = [meta.context_lens[i] for i in seqs]
    q_lens = [meta.query_lens[i] for i in seqs]
    first = [window_start(c, window) // bs for c in ctx]
    last = [(c + q - 1) // bs for c, q in zip(ctx, q_lens)]
    num_blocks = max(b - a + 1 for a, b in zip(first, last))
    first_t = torch.tensor(first, dtype=torch.long).view(-1, 1)  # (S_b, 1)
    # Past a row's last block the entries are clamped to the table (masked, never seen).
    logical = (first_t + torch.arange(num_blocks)).clamp(max=meta.max_blocks - 1)
    tables = meta.block_index.view(meta.num_seqs, meta.max_blocks)  # (S, max_blocks)
    device = tables.device
    rows = tables.index_select(0, torch.tensor(seqs, dtype=torch.long, device=device))
    index = rows.gather(1, logical.to(device)).reshape(-1)  # (S_b * num_blocks,)
    max_q = max(q_lens)
    ctx_t = torch.tensor(ctx, dtype=torch.long).view(-1, 1, 1)  # (S_b, 1, 1)
    q_t = torch.tensor(q_lens, dtype=torch.long).view(-1, 1, 1)
    j = torch.arange(max_q).view(1, max_q, 1)  # (1, Q, 1)
    key = first_t.view(-1, 1, 1) * bs + torch.arange(num_blocks * bs).view(1, 1, -1)
    pos = ctx_t + j  # (S_b, Q, 1) query positions
    mask = (key <= pos) & (key > pos - window) & (key < ctx_t + q_t)  # (S_b, Q, K)
    # Padded query rows see key 0 only, so softmax never meets an all-masked row.
    mask = mask | ((j >= q_t) & (torch.arange(num_blocks * bs) == 0))
    return WindowedRead(index, first, num_blocks, mask.unsqueeze(1).to(device), meta.block_index)
