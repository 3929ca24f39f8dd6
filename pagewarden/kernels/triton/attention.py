"""Triton kernel: paged attention for mixed batches, with the read checks fused in.

Tensor layouts (one layer):

    q, out        (T, n_heads, D)            T = the step's new tokens, sequence-major
    cache         (2, num_blocks, bs, n_kv, D) contiguous; 0 = K, 1 = V
    block_tables  (S, max_blocks) int64      the step's padded tables (meta.block_index)
    seq_info      (3, S) int32               first token, query length, context length

Sequence i brings query_len new tokens after context_len cached ones; its token j sits
at position p = context_len + j and may attend to keys at positions <= p (a decode is
query_len 1, a fresh prompt context_len 0: one kernel covers all three); with a sliding
window of W keys (``SLIDING``), only to keys j with p - W < j <= p, and the blocks before
the tile's first query's first key are not read at all. With ``SOFTCAP`` the scaled
scores become ``softcap * tanh(scores / softcap)`` before the mask and softmax.

Grid (num_tiles, n_kv, num_splits), ``tiles`` (2, num_tiles) int32 naming the (sequence,
query tile) of each program, so a batch of decodes and one long chunk launches as many
programs as it has tiles, not S times the longest. A program owns BLOCK_M query rows of one sequence
and one kv head, the G = n_heads / n_kv query heads of that kv head packed into the rows
(grouped-query attention without repeating K/V), and one split of the key range:

    row r of tile t:  token (t * BLOCK_M + r) // G,  head kv_head * G + (t * BLOCK_M + r) % G
    split s reads logical blocks [lo + s * blocks_per_split, lo + (s + 1) * blocks_per_split)
    lo = 0, or with a window the block of the tile's first query's first key

Loop order: over the split's logical blocks lb, one paged block (bs keys) per iteration,
read in place through ``block_tables[i, lb]`` (no gathered copy); online softmax in
float32. With one split the program writes the output; with more (flash-decoding, for
long contexts and small batches) it writes a partial output and its log-sum-exp, and
``_combine_kernel`` merges the splits.

Checks, through the same block id the K/V were read with, never raised here:

* tags: each key slot read must hold ``expected_tags[i, position]``; a mismatch sets
  ``tag_faults[i, lb] = 1`` (every tile and layer compares what it reads).
* checksums (strict): tile 0 of each sequence reads every cached block its layer reads
  once per (layer, kv head) (its window starts earliest); it adds that block's share of
  the content checksum of ``worker/integrity.py`` to ``read_sums[i, kv_head, lb]``, and
  kv head 0 counts the layer in ``read_layers[i, lb]`` (a sliding layer skips the blocks
  before its window, so only blocks every layer read sum to the block checksum). The scheme is linear mod
  2^64, so summing the shares over kv heads and layers gives the block checksum bit for
  bit. A 32-bit limb of a 16-bit cache is two elements (low half first, little endian):

      limb = hi * 2^16 + (lo & 0xFFFF)   so   key * limb = key * (lo & 0xFFFF) + key * (hi << 16)

  and each element is weighted by the key of its limb (``element_keys``).

``kernels/attention.py`` (plain torch) is the reference the tests compare with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Keys per program of the key loop: enough programs to fill a large GPU before splitting.
_TARGET_PROGRAMS = 128
_MIN_BLOCKS_PER_SPLIT = 4


@triton.jit
def _limb_weights(x, d, ELEM_BITS: tl.constexpr):
    """Each element's share of its 32-bit limb, as int64 (see the module docstring)."""
    if ELEM_BITS == 16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int64)
        return tl.where((d % 2 == 0)[None, :], bits & 0xFFFF, bits << 16)
    else:
        return x.to(tl.int32, bitcast=True).to(tl.int64)


@triton.jit
def _tanh(x):
    """tanh in float32 from exp (saturates to +-1 where exp overflows or vanishes)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _scores(q, k, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    """q (M, D) @ k (N, D)^T in float32."""
    if USE_DOT and IEEE:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    elif USE_DOT:
        return tl.dot(q, tl.trans(k))
    else:
        return tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _weighted(p, v, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    """p (M, N) @ v (N, D) in float32."""
    if USE_DOT and IEEE:
        return tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    elif USE_DOT:
        return tl.dot(p.to(v.dtype), v)
    else:
        return tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _key_blocks(
    tile, split, q_len, ctx, window, blocks_per_split, G: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, SLIDING: tl.constexpr,
):  # fmt: skip
    """(kv_stop, lb_start, lb_stop): the end of the keys the tile needs and the logical
    blocks [lb_start, lb_stop) its split reads."""
    # Keys this tile needs: up to its last token's own position (causal).
    last_tok = tl.minimum(q_len - 1, (tile * BLOCK_M + BLOCK_M - 1) // G)
    kv_stop = ctx + last_tok + 1
    lb_lo = 0
    if SLIDING:  # the block of the tile's first query's first key
        lb_lo = tl.maximum(ctx + (tile * BLOCK_M) // G - window + 1, 0) // BS
    lb_start = lb_lo + split * blocks_per_split
    lb_stop = tl.minimum(tl.cdiv(kv_stop, BS), lb_start + blocks_per_split)
    if tile * BLOCK_M >= q_len * G:  # a tile past this sequence's rows reads nothing
        lb_stop = lb_start
    return kv_stop, lb_start, lb_stop


@triton.jit
def _check_slot_tags(
    slot_tags_ptr, expected_tags_ptr, tag_faults_ptr, block, seq, lb, pos, o, key_ok,
    stride_exp, stride_bt, BS: tl.constexpr,
):  # fmt: skip
    """Flag logical block ``lb`` of sequence ``seq`` in ``tag_faults`` when a slot it
    reads (physical ``block``, offsets ``o``, positions ``pos``) holds another token's tag."""
    got = tl.load(slot_tags_ptr + block * BS + o, mask=key_ok, other=0)
    want = tl.load(expected_tags_ptr + seq * stride_exp + pos, mask=key_ok, other=0)
    n_bad = tl.sum(((got != want) & key_ok).to(tl.int32), axis=0)
    tl.store(tag_faults_ptr + seq * stride_bt + lb, 1, mask=n_bad > 0)


@triton.jit
def _add_block_checksum(
    k, v, element_keys_ptr, offset_keys_ptr, read_sums_ptr, read_layers_ptr, seq, kv_head, lb,
    d, o, stride_bt, HKV: tl.constexpr, D: tl.constexpr, ELEM_BITS: tl.constexpr,
):  # fmt: skip
    """Add this KV head's share of the block checksum of ``k`` and ``v`` (BS, D), as read,
    to ``read_sums[seq, kv_head, lb]``; kv head 0 counts the layer in ``read_layers``."""
    keys_k = tl.load(element_keys_ptr + kv_head * D + d)  # (D,) int64
    keys_v = tl.load(element_keys_ptr + HKV * D + kv_head * D + d)
    wk = _limb_weights(k, d, ELEM_BITS)  # (BS, D) int64
    wv = _limb_weights(v, d, ELEM_BITS)
    slot_sum = tl.sum(wk * keys_k[None, :] + wv * keys_v[None, :], axis=1)
    share = tl.sum(slot_sum * tl.load(offset_keys_ptr + o), axis=0)
    sums = read_sums_ptr + (seq * HKV + kv_head) * stride_bt + lb
    tl.store(sums, tl.load(sums) + share)
    if kv_head == 0:
        layers = read_layers_ptr + seq * stride_bt + lb
        tl.store(layers, tl.load(layers) + 1)


@triton.jit
def _masked_scores(
    q, k, pos, key_ok, ctx, tok, scale_log2, window, softcap, USE_DOT: tl.constexpr,
    IEEE: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Scores (M, BS) of q against k in log2 units, soft-capped with ``SOFTCAP``, and
    -inf where a key is past the query (causal), outside its window or not read."""
    if SOFTCAP:  # softcap * tanh(scale * s / softcap), in log2 units
        raw = _scores(q, k, USE_DOT, IEEE) * (scale_log2 / 1.4426950408889634)
        s = _tanh(raw / softcap) * (softcap * 1.4426950408889634)
    else:
        s = _scores(q, k, USE_DOT, IEEE) * scale_log2  # (M, BS)
    allowed = (pos[None, :] <= ctx + tok[:, None]) & key_ok[None, :]
    if SLIDING:
        allowed = allowed & (pos[None, :] > ctx + tok[:, None] - window)
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def _store_result(
    acc, m_i, l_i, out_ptr, part_out_ptr, part_lse_ptr, q_rows, head, row_ok, d, split,
    stride_ot, stride_oh, G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """The tile's output rows (one split), or its partial output and log2-sum-exp for
    ``_combine_kernel`` (several splits)."""
    if NUM_SPLITS == 1:
        out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        dst = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # Partials indexed (token, head, split): log2-sum-exp, -inf for an empty split.
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1.0e-30)), float("-inf"))
        part = (q_rows * (HKV * G) + head) * NUM_SPLITS + split  # (M,)
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        tl.store(part_out_ptr + part[:, None] * D + d[None, :], out, mask=row_ok[:, None])


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, cache_ptr, block_tables_ptr, seq_info_ptr,  # the step's tensors
    part_out_ptr, part_lse_ptr,  # per-split partials (NUM_SPLITS > 1)
    slot_tags_ptr, expected_tags_ptr, tag_faults_ptr,  # the tag check (CHECK_TAGS)
    element_keys_ptr, offset_keys_ptr, read_sums_ptr, read_layers_ptr,  # checksums (CHECKSUM)
    scale_log2, window, softcap, num_seqs, tiles_ptr, num_tiles, blocks_per_split,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kv, stride_bt, stride_exp,
    G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr, CHECK_TAGS: tl.constexpr,
    CHECKSUM: tl.constexpr, ELEM_BITS: tl.constexpr, USE_DOT: tl.constexpr,
    IEEE: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    seq = tl.load(tiles_ptr + tl.program_id(0))
    tile = tl.load(tiles_ptr + num_tiles + tl.program_id(0))
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(seq_info_ptr + seq)
    q_len = tl.load(seq_info_ptr + num_seqs + seq)
    ctx = tl.load(seq_info_ptr + 2 * num_seqs + seq)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // G  # (M,) query token within the sequence
    head = kv_head * G + rows % G  # (M,) query head
    row_ok = tok < q_len
    d = tl.arange(0, D)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    ).to(cache_ptr.dtype.element_ty)  # (M, D)

    kv_stop, lb_start, lb_stop = _key_blocks(
        tile, split, q_len, ctx, window, blocks_per_split, G, BS, BLOCK_M, SLIDING
    )  # fmt: skip

    o = tl.arange(0, BS)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for lb in range(lb_start, lb_stop):
        block = tl.load(block_tables_ptr + seq * stride_bt + lb).to(tl.int64)
        pos = lb * BS + o  # (BS,) key positions
        key_ok = pos < kv_stop
        kv = cache_ptr + block * (BS * HKV * D) + o[:, None] * (HKV * D) + kv_head * D + d[None, :]
        k = tl.load(kv, mask=key_ok[:, None], other=0.0)  # (BS, D)
        v = tl.load(kv + stride_kv, mask=key_ok[:, None], other=0.0)  # (BS, D)
        if CHECK_TAGS:
            _check_slot_tags(
                slot_tags_ptr, expected_tags_ptr, tag_faults_ptr, block, seq, lb, pos, o,
                key_ok, stride_exp, stride_bt, BS,
            )  # fmt: skip
        if CHECKSUM:
            if tile == 0:  # one tile of the sequence sums each block once
                _add_block_checksum(
                    k, v, element_keys_ptr, offset_keys_ptr, read_sums_ptr, read_layers_ptr,
                    seq, kv_head, lb, d, o, stride_bt, HKV, D, ELEM_BITS,
                )  # fmt: skip
        s = _masked_scores(
            q, k, pos, key_ok, ctx, tok, scale_log2, window, softcap, USE_DOT, IEEE, SLIDING,
            SOFTCAP,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # (M, BS)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _weighted(p, v, USE_DOT, IEEE)
        m_i = m_new

    _store_result(
        acc, m_i, l_i, out_ptr, part_out_ptr, part_lse_ptr, q_rows, head, row_ok, d, split,
        stride_ot, stride_oh, G, HKV, D, NUM_SPLITS,
    )  # fmt: skip


@triton.jit
def _combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    H: tl.constexpr,
    D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """out[t, h] = sum_s w_s * part_out[t, h, s] with w_s = softmax over lse_s."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, D)
    base = (t * H + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + sp, mask=sp < NUM_SPLITS, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))  # (SPLITS_P2,) the token's own key is in one
    parts = tl.load(
        part_out_ptr + (base + sp)[:, None] * D + d[None, :],
        mask=(sp < NUM_SPLITS)[:, None],
        other=0.0,
    )
    out = tl.sum(w[:, None] * parts, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@dataclass
class ReadCheckBuffers:
    """The fused checks' tensors for one step (see the module docstring)."""

    slot_tags: torch.Tensor  # (num_blocks * bs,) int64, the guard's tag store
    expected_tags: torch.Tensor  # (S, >= kv_len) int64
    tag_faults: torch.Tensor  # (S, max_blocks) int32, out
    read_sums: torch.Tensor | None  # (S, n_kv, max_blocks) int64, out; None: no checksums
    element_keys: torch.Tensor | None  # (2, n_kv * D) int64, this layer's keys
    offset_keys: torch.Tensor | None  # (bs,) int64
    # (S, max_blocks) int32, out: layers that added their checksum shares; None: not kept
    read_layers: torch.Tensor | None = None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def query_tiles(query_lens: list[int], group: int, block_m: int = 16) -> torch.Tensor:
    """(2, num_tiles) int32: sequence and tile index of each query tile of the step."""
    seqs = [i for i, n in enumerate(query_lens) for _ in range(triton.cdiv(n * group, block_m))]
    tiles = [t for n in query_lens for t in range(triton.cdiv(n * group, block_m))]
    return torch.tensor([seqs, tiles], dtype=torch.int32)


def choose_num_splits(num_tiles: int, num_kv_heads: int, max_blocks: int) -> int:
    """Split the key range only when the other grid axes leave the GPU idle."""
    programs = num_tiles * num_kv_heads
    wanted = triton.cdiv(_TARGET_PROGRAMS, programs)
    return max(1, min(wanted, max_blocks // _MIN_BLOCKS_PER_SPLIT))


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_info: torch.Tensor,
    max_query_len: int,
    scale: float,
    checks: ReadCheckBuffers | None = None,
    num_splits: int | None = None,
    block_m: int = 16,
    tiles: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of q (T, n_heads, D) over the paged cache; returns (T, n_heads, D).
    ``sliding_window`` and ``softcap`` as ``AttentionOps.attend`` says (None: off).

    ``tiles`` is ``query_tiles(query_lens, G, block_m)`` on q's device; None: every
    sequence gets the tiles of the longest query (simpler, more idle programs).
    """
    t, n_heads, head_dim = q.shape
    _, _, bs, n_kv, _ = cache.shape
    num_seqs, max_blocks = block_tables.shape
    assert cache.is_contiguous() and block_tables.is_contiguous() and q.stride(2) == 1
    assert n_heads % n_kv == 0 and seq_info.shape == (3, num_seqs)
    for n, what in ((bs, "block_size"), (head_dim, "head_dim")):
        assert n & (n - 1) == 0, f"the Triton kernel needs a power-of-two {what}, got {n}"
    group = n_heads // n_kv
    if tiles is None:
        q_tiles = triton.cdiv(max_query_len * group, block_m)
        program = torch.arange(num_seqs * q_tiles, dtype=torch.int32, device=q.device)
        tiles = torch.stack([program // q_tiles, program % q_tiles])
    num_tiles = tiles.shape[1]
    # Blocks one tile may read: all, or those a window and the tile's tokens can touch.
    span = max_blocks
    if sliding_window is not None:
        keys = sliding_window - 1 + block_m // group + 1
        span = min(max_blocks, triton.cdiv(keys, bs) + 1)
    if num_splits is None:
        num_splits = choose_num_splits(num_tiles, n_kv, span)
    blocks_per_split = triton.cdiv(span, num_splits)
    out = torch.empty_like(q)
    part_out, part_lse = _partials(q, num_splits, out)
    unused = block_tables  # stands in for the pointers of checks that are off
    tag_args, sum_args, stride_exp = _check_pointers(checks, unused, q.device)
    tags_on, sums_on = checks is not None, sum_args[0] is not unused
    elem_bits = cache.element_size() * 8
    assert not sums_on or elem_bits in (16, 32), "checksums need a 16- or 32-bit cache"
    _paged_attention_kernel[(num_tiles, n_kv, num_splits)](
        q, out, cache, block_tables, seq_info,
        part_out, part_lse,
        *tag_args,
        *sum_args,
        scale * 1.4426950408889634,  # exp(x) = exp2(x * log2(e))
        sliding_window or 0, softcap or 1.0,
        num_seqs, tiles, num_tiles, blocks_per_split,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0), max_blocks,
        stride_exp,
        G=group, HKV=n_kv, D=head_dim, BS=bs, BLOCK_M=block_m, NUM_SPLITS=num_splits,
        CHECK_TAGS=tags_on, CHECKSUM=sums_on, ELEM_BITS=elem_bits,
        USE_DOT=min(bs, head_dim, block_m) >= 16,
        # float32 caches must not round through tf32; the interpreter's tl.dot mishandles
        # 16-bit floats, so there the products (exact in float32) are formed in float32.
        IEEE=cache.dtype == torch.float32 or _interpreting(),
        SLIDING=sliding_window is not None, SOFTCAP=softcap is not None,
    )  # fmt: skip
    if num_splits > 1:
        _combine_kernel[(t, n_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            H=n_heads,
            D=head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits),
        )
    return out


def _check_pointers(
    checks: ReadCheckBuffers | None, unused: torch.Tensor, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], int]:
    """The kernel's tag-check and checksum pointers (``unused``, the (S, max_blocks) block
    tables, for a check that is off) and the row stride of the expected tags. Without
    ``checks.read_layers`` the layers are counted in a scratch tensor, then dropped."""
    tag_args: tuple[torch.Tensor, ...] = (unused,) * 3
    sum_args: tuple[torch.Tensor, ...] = (unused,) * 4
    stride_exp = 0
    if checks is not None:
        tag_args = (checks.slot_tags, checks.expected_tags, checks.tag_faults)
        stride_exp = checks.expected_tags.stride(0)
        if checks.read_sums is not None:
            assert checks.element_keys is not None and checks.offset_keys is not None
            layers = checks.read_layers
            if layers is None:  # counted, then dropped
                num_seqs, max_blocks = unused.shape
                layers = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=device)
            sum_args = (checks.element_keys, checks.offset_keys, checks.read_sums, layers)
    return tag_args, sum_args, stride_exp


def _partials(
    q: torch.Tensor, num_splits: int, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split partial outputs (T * n_heads * splits, D) and log2-sum-exps (T * n_heads *
    splits,) in float32; with one split the kernel writes ``out`` directly."""
    if num_splits == 1:
        return out, out
    t, n_heads, head_dim = q.shape
    part_lse = torch.empty(t * n_heads * num_splits, dtype=torch.float32, device=q.device)
    part_out = torch.empty(t * n_heads * num_splits, head_dim, dtype=torch.float32, device=q.device)
    return part_out, part_lse
