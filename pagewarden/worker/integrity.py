"""Integrity kernels over the physical KV cache: content checksums and slot tags.

Two independent defences, both plain torch ops that run on the cache's device:

* **Content checksums** catch bits that change in stored K/V (data integrity).
* **Slot tags** catch K/V that is intact but in the wrong place (indexing): a block table
  entry or slot index that points at another sequence's tokens.

Checksum scheme (multilinear hash over 32-bit limbs, arithmetic mod 2^64)
-------------------------------------------------------------------------
The bytes of one token slot, across every layer, K then V, are viewed as signed 32-bit
limbs ``x_i`` (an ``int32`` bitcast of the contiguous row; works for bf16/fp16 (two
elements per limb) and fp32 (one)). With fixed odd 64-bit keys ``m_i``::

    slot_sum  = sum_i  m_i * x_i            mod 2^64      (one key per (layer, K/V, limb))
    block_sum = sum_o  c_o * slot_sum[o]    mod 2^64      (one odd key per block offset)

Why it holds:

* **Every single-bit flip changes it, always.** Flipping bit ``k <= 31`` of limb ``i``
  changes the signed ``x_i`` by ``±2^k``, so ``slot_sum`` changes by ``±2^k * m_i``.
  ``m_i`` is odd, so that product has 2-adic valuation ``k < 64`` and is nonzero mod
  2^64. ``block_sum`` then changes by ``c_o * Δ`` with ``c_o`` odd, again nonzero. No
  probability involved.
* **Random multi-byte corruption**: for a difference vector whose lowest-valuation limb
  difference is ``2^v * odd`` (``v <= 31``), ``sum m_i d_i`` over random odd keys is 0 mod
  2^64 with probability at most ``2^-(63-v) <= 2^-32``, the required bound, and far
  below it for typical corruption (random bytes have ``v = 0`` with probability 1/2,
  ``v >= 8`` with probability 2^-8). Folding slots with the odd ``c_o`` keeps the same
  bound. Keys differ per position, so swapped or shifted content is caught too.
* **Cost**: one widening and one multiply-add per 32-bit limb (two bf16 values). On CPU
  ``worker/integrity_cpu.py`` runs it as numba loops that read blocks in place (~0.8 ns
  per limb on an AVX2 core); elsewhere, and where numba is missing, as an int64
  matrix-vector product per layer (~2.5 ns per limb on CPU), no temporaries bigger than
  one layer's gathered rows.
  Integer ops only, so results are bit-identical on CPU and CUDA. 32-bit limbs halve the
  work of 16-bit ones (measured 5.8x faster on CPU, with the per-block gather) at the
  price of the worst-case bound going from 2^-48 to 2^-32.

torch int64 ``*`` and ``sum`` wrap two's-complement on CPU and CUDA, which is exactly
arithmetic mod 2^64; ``tests/worker/test_integrity.py`` checks the kernels against a
pure-Python mod-2^64 reference so a backend that did not wrap would fail loudly. Keys come
from splitmix64 of their index (computed with integer torch ops, not an RNG), so a
checksum recorded in one process verifies in another and on another device.

Checksums are content-only: the block id is not mixed in, so a copy-on-write copy or a
swap-in to a different block id verifies against the checksum sealed for the source.
Placement is the slot tags' job.

Slot tags
---------
Every physical slot carries ``tag_p = mix64(tag_{p-1}, token_p, p)``, written by the same
scatter (``slot_mapping``) as K/V and read back through the same gather (block table ->
slot) as attention::

    block_table = [7, 3], block_size = 4     position p -> slot block_table[p // 4]*4 + p % 4
    positions 0..3 -> slots 28..31 (block 7),   positions 4..5 -> slots 12..13 (block 3)

Tags depend only on the token chain, so two requests that share a prefix share its tags,
and a shared prefix-cache block verifies for both. A tag of 0 is what a never-written slot
holds; a real tag is 0 with probability 2^-64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from pagewarden.worker import integrity_cpu

MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# Disjoint key streams: limb keys and offset keys must not share values.
_OFFSET_STREAM = 1 << 40

# Root of every token chain: prev_tag of position 0 (callers may salt it per tenant/model).
ROOT_TAG = 0x6A09E667F3BCC908

IntegrityKind = Literal["checksum", "slot_tag"]


# --------------------------------------------------------------------------- errors


class IntegrityError(Exception):
    """Base class for integrity failures detected in the physical KV cache."""


class KVIntegrityError(IntegrityError):
    """Stored KV failed a check. Quarantine ``block_ids`` and recompute whoever read them.

    ``kind`` is ``"checksum"`` (bytes changed) or ``"slot_tag"`` (a slot holds another
    position's or request's tokens: an indexing fault).
    """

    def __init__(self, kind: IntegrityKind, block_ids: list[int], message: str) -> None:
        if kind not in ("checksum", "slot_tag"):
            raise ValueError(f"unknown integrity kind {kind!r}")
        super().__init__(f"[{kind}] blocks {sorted(set(block_ids))}: {message}")
        self.kind: IntegrityKind = kind
        self.block_ids: tuple[int, ...] = tuple(sorted(set(block_ids)))
        self.message = message


# --------------------------------------------------------------------------- 64-bit helpers


def to_signed64(value: int) -> int:
    """The int64 (two's complement) that stores the unsigned 64-bit ``value``."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


def splitmix64(x: int) -> int:
    """The splitmix64 finaliser of ``x`` (unsigned 64-bit in, unsigned 64-bit out)."""
    z = (x + _GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & MASK64
    return z ^ (z >> 31)


def _srl(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _splitmix64_tensor(index: torch.Tensor) -> torch.Tensor:
    """splitmix64 of each int64 ``index``, computed in wrapping int64 torch ops."""
    z = index + to_signed64(_GOLDEN)
    z = (z ^ _srl(z, 30)) * to_signed64(_MIX1)
    z = (z ^ _srl(z, 27)) * to_signed64(_MIX2)
    return z ^ _srl(z, 31)


_KEY_CACHE: dict[tuple[int, int, str], torch.Tensor] = {}


def _odd_keys(start: int, count: int, device: torch.device) -> torch.Tensor:
    """``count`` fixed odd 64-bit keys from stream position ``start``. (count,) int64."""
    cache_key = (start, count, str(device))
    keys = _KEY_CACHE.get(cache_key)
    if keys is None:
        idx = torch.arange(start, start + count, dtype=torch.int64, device=device)
        keys = _splitmix64_tensor(idx) | 1
        _KEY_CACHE[cache_key] = keys
    return keys


def _limb_keys(num_layers: int, limbs_per_row: int, device: torch.device) -> torch.Tensor:
    """One odd key per (layer, K/V, limb). (num_layers, 2, limbs_per_row) int64."""
    keys = _odd_keys(0, num_layers * 2 * limbs_per_row, device)
    return keys.view(num_layers, 2, limbs_per_row)


def _offset_keys(block_size: int, device: torch.device) -> torch.Tensor:
    """One odd key per offset within a block. (block_size,) int64."""
    return _odd_keys(_OFFSET_STREAM, block_size, device)


# --------------------------------------------------------------------------- checksums


def _slot_rows(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache as 32-bit limbs per slot: (2, num_blocks * block_size, limbs) int32."""
    two, num_blocks, block_size = cache.shape[:3]
    assert two == 2, f"cache must be (2, num_blocks, block_size, heads, dim), got {cache.shape}"
    assert cache.is_contiguous(), "checksums bitcast the cache; it must be contiguous"
    row_bytes = cache[0, 0, 0].numel() * cache.element_size()
    assert row_bytes % 4 == 0, f"a slot row has {row_bytes} bytes; 32-bit limbs need 4k"
    return cache.view(torch.int32).view(2, num_blocks * block_size, row_bytes // 4)


def _row_limbs(cache: torch.Tensor) -> int:
    """32-bit limbs in one slot row of a layer's cache (2, num_blocks, block_size, ...),
    from its shape alone (``_slot_rows`` builds the views; a step's few slots need only
    the count)."""
    row_bytes = math.prod(cache.shape[3:]) * cache.element_size()
    assert row_bytes % 4 == 0, f"a slot row has {row_bytes} bytes; 32-bit limbs need 4k"
    return row_bytes // 4


def _sum_over_layers(
    caches: list[torch.Tensor], rows_of: Callable[[torch.Tensor], torch.Tensor], num_rows: int
) -> torch.Tensor:
    """``sum_layer mv(rows_of(cache_layer)[kv], keys[layer, kv])``, (num_rows,) int64.

    ``rows_of`` maps one layer's cache to its selected rows as int32 limbs, shaped
    (2, num_rows, limbs). One loop on the calling thread: splitting layers across worker
    threads made the checksum alone 2.4x faster on 2 cores, but the workers' own OpenMP
    thread teams then slowed the model's next ops, and end to end it was slower.
    """
    device = caches[0].device
    keys = _limb_keys(len(caches), _slot_rows(caches[0]).shape[-1], device)

    total = torch.zeros(num_rows, dtype=torch.int64, device=device)
    for layer, cache in enumerate(caches):
        limbs = rows_of(cache).to(torch.int64)  # (2, num_rows, limbs)
        # (num_rows, limbs) @ (limbs,) for K and V: multiply and sum fused; int64 wraps,
        # i.e. arithmetic mod 2^64.
        total += torch.mv(limbs[0], keys[layer, 0]) + torch.mv(limbs[1], keys[layer, 1])
    return total


def slot_checksums(caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """Checksum of each slot's K and V bytes across all layers. (num_slots,) int64.

    Call it on ``slot_mapping`` right after the K/V scatter to record write-time sums.
    """
    assert caches, "need at least one layer"
    slots = slots.to(device=caches[0].device, dtype=torch.int64).reshape(-1)
    if integrity_cpu.usable(caches):
        limbs = _row_limbs(caches[0])
        return integrity_cpu.slot_sums(caches, slots, _limb_keys(len(caches), limbs, slots.device))
    return _sum_over_layers(
        caches, lambda cache: _slot_rows(cache).index_select(1, slots), slots.numel()
    )


class SlotChecksums:
    """``slot_checksums`` over one fixed list of layer caches, with which kernel computes
    them and its keys resolved once: after every step's forward pass the guard sums the
    slots just written (one, at one stream), where resolving them again per call cost
    about a third of the call."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches
        cpu = integrity_cpu.usable(caches)
        limbs = _row_limbs(caches[0])
        keys = _limb_keys(len(caches), limbs, caches[0].device) if cpu else None
        # the C++ kernel with the caches bound: no list of layer tensors to convert per call
        self._bound = integrity_cpu.cache_sums(caches, keys) if keys is not None else None

    def _kernel(self, slots: torch.Tensor):
        """The bound C++ kernel where it takes ``slots``; None: the torch path."""
        if (
            self._bound is not None
            and integrity_cpu.enabled  # tests switch the C++ kernels off
            and slots.dtype == torch.int64
            and slots.dim() == 1
            and slots.device.type == "cpu"
        ):
            return self._bound
        return None

    def __call__(self, slots: torch.Tensor) -> torch.Tensor:
        """``slot_checksums(caches, slots)``. (num_slots,) int64."""
        bound = self._kernel(slots)
        return slot_checksums(self.caches, slots) if bound is None else bound.slot_sums(slots)

    def store(self, slots: torch.Tensor, into: torch.Tensor) -> None:
        """``into[slots] = self(slots)``: write-time sums recorded in one call on the CPU."""
        bound = self._kernel(slots)
        if bound is not None and into.device.type == "cpu":
            bound.store_slot_sums(slots, into)
        elif slots.device.type == "cpu" and into.device.type == "cpu":
            into.numpy()[slots.numpy()] = self(slots).numpy()  # numpy's: torch's index_put
        else:  # costs tens of microseconds more
            into[slots] = self(slots)


def decode_guard(caches: list[torch.Tensor], *state: torch.Tensor) -> Any | None:
    """The C++ ``DecodeGuard`` (``kernels/cpu/checksum.cpp``) with this module's keys,
    bound to ``caches`` and a guard's state (sealed, tags, slot sums, block sums): a decode
    step's checks at ``standard`` in two calls. None where the C++ kernels do not checksum
    ``caches`` or the state is not in host memory."""
    if not integrity_cpu.usable(caches) or any(t.device.type != "cpu" for t in state):
        return None
    device, block_size = caches[0].device, caches[0].shape[2]
    keys = _limb_keys(len(caches), _row_limbs(caches[0]), device)
    offsets = _offset_keys(block_size, device)
    return integrity_cpu.decode_guard(caches, keys, offsets, *(t.view(-1) for t in state))


def combine_slot_checksums(slot_sums: torch.Tensor) -> torch.Tensor:
    """Block checksums from per-slot checksums. (num_blocks, block_size) -> (num_blocks,).

    Pure arithmetic, no byte reads: sealing from the sums recorded at write time gives the
    checksum of the content as written, so corruption between write and seal is caught at
    the next verify.
    """
    assert slot_sums.dim() == 2 and slot_sums.dtype == torch.int64, slot_sums.shape
    keys = _offset_keys(slot_sums.shape[1], slot_sums.device)
    return (slot_sums * keys).sum(dim=1)


def _block_slots(block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slots of each block. (num_blocks,) -> (num_blocks, block_size)."""
    offsets = torch.arange(block_size, dtype=torch.int64, device=block_ids.device)
    return block_ids.to(torch.int64).unsqueeze(1) * block_size + offsets


def block_checksums(caches: list[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """Content checksum of each block, K and V of all layers. (num_blocks,) int64.

    Same value as ``combine_slot_checksums(slot_checksums(...))`` over the blocks' slots,
    but gathers whole blocks (one contiguous row each), which is what makes reading every
    block of a step affordable in ``strict``.
    """
    device = caches[0].device
    _, num_blocks, block_size = caches[0].shape[:3]
    block_ids = block_ids.to(device=device, dtype=torch.int64).reshape(-1)
    limbs_per_row = _row_limbs(caches[0])
    n = block_ids.numel()
    if integrity_cpu.usable(caches):
        return integrity_cpu.block_sums(
            caches,
            block_ids,
            _limb_keys(len(caches), limbs_per_row, device),
            _offset_keys(block_size, device),
        )

    def rows_of(cache: torch.Tensor) -> torch.Tensor:
        blocks = cache.view(torch.int32).view(2, num_blocks, block_size * limbs_per_row)
        # (2, n, bs * limbs) -> (2, n * bs, limbs): one row per slot, K and V
        return blocks.index_select(1, block_ids).view(2, n * block_size, limbs_per_row)

    sums = _sum_over_layers(caches, rows_of, n * block_size)
    return combine_slot_checksums(sums.view(n, block_size))


def verify_blocks(
    caches: list[torch.Tensor], block_ids: torch.Tensor, expected: torch.Tensor
) -> list[int]:
    """Ids of the blocks whose content no longer matches ``expected`` (sealed) checksums."""
    actual = block_checksums(caches, block_ids)
    bad = actual != expected.to(actual.device)
    return block_ids.reshape(-1)[bad.cpu()].tolist() if bad.any() else []


def check_blocks(
    caches: list[torch.Tensor], block_ids: torch.Tensor, expected: torch.Tensor
) -> None:
    """Raise ``KVIntegrityError("checksum")`` if any block fails ``verify_blocks``."""
    bad = verify_blocks(caches, block_ids, expected)
    if bad:
        raise KVIntegrityError(
            "checksum",
            bad,
            "stored K/V bytes changed since the block was sealed; quarantine the blocks "
            "and recompute the requests that read them",
        )


@dataclass(frozen=True, slots=True)
class SlotMismatch:
    """A slot whose current checksum differs from the one recorded at write time."""

    block_id: int
    offset: int


def verify_slots(
    caches: list[torch.Tensor], slots: torch.Tensor, recorded: torch.Tensor
) -> list[SlotMismatch]:
    """Slots whose bytes changed since ``recorded`` (write-time) checksums were taken.

    Use it for open (partially filled) blocks, which have no block checksum yet.
    """
    block_size = caches[0].shape[2]
    slots = slots.to(torch.int64).reshape(-1)
    bad = (slot_checksums(caches, slots) != recorded.to(caches[0].device)).cpu()
    return [SlotMismatch(s // block_size, s % block_size) for s in slots[bad].tolist()]


def seal_blocks(
    caches: list[torch.Tensor], block_ids: torch.Tensor, recorded: torch.Tensor
) -> torch.Tensor:
    """Re-verify each full block's slots, then its block checksum. (num_blocks,) int64.

    ``recorded`` is (num_blocks, block_size): the slot checksums taken at write time. Every
    slot must still match it, otherwise ``KVIntegrityError("checksum")`` names the blocks;
    the checksum returned is formed from those verified slots.
    """
    block_size = caches[0].shape[2]
    block_ids = block_ids.to(torch.int64).reshape(-1)
    slots = _block_slots(block_ids, block_size).reshape(-1)
    bad = verify_slots(caches, slots, recorded.reshape(-1))
    if bad:
        raise KVIntegrityError(
            "checksum",
            [m.block_id for m in bad],
            f"{len(bad)} slot(s) changed between write and seal "
            f"(first: block {bad[0].block_id} offset {bad[0].offset}); do not seal or "
            "cache these blocks, recompute their tokens",
        )
    return combine_slot_checksums(recorded.to(caches[0].device).view(-1, block_size))


# --------------------------------------------------------------------------- slot tags


def mix64(prev_tag: int, token_id: int, position: int) -> int:
    """Tag of ``token_id`` at ``position`` after a chain ending in ``prev_tag`` (int64)."""
    x = splitmix64((prev_tag & MASK64) ^ _MIX1)
    x = splitmix64(x ^ (token_id & MASK64))
    x = splitmix64(x ^ ((position & MASK64) * _GOLDEN & MASK64))
    return to_signed64(x)


def token_chain_tags(prev_tag: int, token_ids: list[int], start_position: int) -> list[int]:
    """Tags of ``token_ids`` at positions ``start_position, ...``; pass ``ROOT_TAG`` at 0.

    Deterministic in (chain, position): requests with the same prefix get the same tags.
    """
    tags: list[int] = []
    tag = prev_tag
    for i, token in enumerate(token_ids):
        tag = mix64(tag, token, start_position + i)
        tags.append(tag)
    return tags


@dataclass(frozen=True, slots=True)
class TagMismatch:
    """Position ``position`` of sequence ``seq_index`` read a slot of ``block_id`` that
    holds some other token's tag."""

    seq_index: int
    position: int
    block_id: int


class SlotTags:
    """The token-identity tag of every physical slot.

    Invariant: ``tags[b, o]`` is the tag of the token whose K/V was last scattered into
    slot ``b * block_size + o`` (0 if never written). It is written only by ``write``,
    through the same ``slot_mapping`` as K/V.
    """

    def __init__(
        self, num_blocks: int, block_size: int, device: torch.device | str = "cpu"
    ) -> None:
        self.block_size = block_size
        self.tags = torch.zeros(num_blocks, block_size, dtype=torch.int64, device=device)

    def write(self, slot_mapping: torch.Tensor, tags: torch.Tensor | list[int]) -> None:
        """Scatter ``tags`` (num_tokens,) into ``slot_mapping`` (num_tokens,) slots."""
        slots = torch.as_tensor(slot_mapping, dtype=torch.int64, device=self.tags.device)
        values = torch.as_tensor(tags, dtype=torch.int64, device=self.tags.device)
        assert slots.shape == values.shape, (slots.shape, values.shape)
        self.tags.view(-1).index_copy_(0, slots.reshape(-1), values.reshape(-1))

    def verify(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor | list[int], expected: torch.Tensor
    ) -> list[TagMismatch]:
        """Positions whose slot, read through the block tables, holds the wrong tag.

        ``block_tables`` (S, max_blocks) int64, ``seq_lens`` (S,), ``expected`` (S, max_len)
        int64 with ``expected[s, p]`` the tag of sequence s's token at position p (entries
        at p >= seq_lens[s] are ignored).
        """
        device = self.tags.device
        block_tables = torch.as_tensor(block_tables, dtype=torch.int64, device=device)
        seq_lens = torch.as_tensor(seq_lens, dtype=torch.int64, device=device)
        expected = torch.as_tensor(expected, dtype=torch.int64, device=device)
        max_len = expected.shape[1]
        pos = torch.arange(max_len, dtype=torch.int64, device=device)  # (max_len,)
        valid = pos.unsqueeze(0) < seq_lens.unsqueeze(1)  # (S, max_len)
        assert int(seq_lens.max()) <= block_tables.shape[1] * self.block_size, (
            "a sequence is longer than its block table covers"
        )
        # Positions past a table's end are masked out by ``valid``; clamp just keeps the
        # gather in range.
        block_idx = torch.clamp(pos // self.block_size, max=block_tables.shape[1] - 1)
        blocks = block_tables[:, block_idx]  # (S, max_len)
        slots = blocks * self.block_size + pos % self.block_size  # same as attention
        got = self.tags.view(-1)[slots]  # (S, max_len)
        bad = (got != expected) & valid
        if not bad.any():
            return []
        seq_i, pos_i = bad.nonzero(as_tuple=True)
        return [
            TagMismatch(s, p, blocks[s, p].item()) for s, p in zip(seq_i.tolist(), pos_i.tolist())
        ]

    def check(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor | list[int], expected: torch.Tensor
    ) -> None:
        """Raise ``KVIntegrityError("slot_tag")`` if ``verify`` finds any mismatch."""
        bad = self.verify(block_tables, seq_lens, expected)
        if bad:
            first = bad[0]
            raise KVIntegrityError(
                "slot_tag",
                [m.block_id for m in bad],
                f"{len(bad)} position(s) read a slot holding another token's K/V (first: "
                f"sequence {first.seq_index} position {first.position} in block "
                f"{first.block_id}); the block table or slot mapping is wrong, recompute",
            )
