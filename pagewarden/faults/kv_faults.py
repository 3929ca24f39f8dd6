"""Fault injectors over the physical KV cache, for tests, benchmarks and chaos runs.

Each injector changes state in place and returns a small dataclass saying exactly what it
changed, so a test can assert that the matching defence fired on that block.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from pagewarden.worker.integrity import SlotTags


@dataclass(frozen=True, slots=True)
class BitFlip:
    """One bit flipped in a stored K or V byte."""

    layer: int
    kv: int  # 0 = K, 1 = V
    block_id: int
    offset: int  # slot offset within the block
    byte_index: int  # byte within the slot's (num_kv_heads, head_dim) row
    bit: int  # 0..7 within that byte


@dataclass(frozen=True, slots=True)
class TagCorruption:
    """A slot tag overwritten with a different value."""

    block_id: int
    offset: int
    old_tag: int
    new_tag: int


@dataclass(frozen=True, slots=True)
class BlockTableRedirect:
    """A block-table entry pointed at another physical block."""

    index: int
    old_block: int
    new_block: int


def _slot_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache as bytes: (2, num_blocks, block_size, row_bytes) uint8 (a view)."""
    two, num_blocks, block_size = cache.shape[:3]
    return cache.view(torch.uint8).view(two, num_blocks, block_size, -1)


def _flip(
    caches: list[torch.Tensor],
    layer: int,
    block_id: int,
    offset: int,
    rng: random.Random,
    kv: int | None,
) -> BitFlip:
    data = _slot_bytes(caches[layer])
    kv = rng.randrange(2) if kv is None else kv
    byte_index = rng.randrange(data.shape[-1])
    bit = rng.randrange(8)
    # uint8 ^ (1 << 7) stays in range; XOR twice restores the byte.
    data[kv, block_id, offset, byte_index] ^= 1 << bit
    return BitFlip(layer, kv, block_id, offset, byte_index, bit)


def flip_bit(
    caches: list[torch.Tensor], block_id: int, layer: int, rng: random.Random, kv: int | None = None
) -> BitFlip:
    """Flip one random bit of K or V anywhere in ``block_id`` of ``layer``."""
    offset = rng.randrange(caches[layer].shape[2])
    return _flip(caches, layer, block_id, offset, rng, kv)


def flip_slot_bit(
    caches: list[torch.Tensor], slot: int, layer: int, rng: random.Random, kv: int | None = None
) -> BitFlip:
    """Flip one random bit of the K/V in flat ``slot`` (e.g. a written slot of an open block)."""
    block_size = caches[layer].shape[2]
    return _flip(caches, layer, slot // block_size, slot % block_size, rng, kv)


def undo_bit_flip(caches: list[torch.Tensor], flip: BitFlip) -> None:
    """Restore the bit that ``flip`` changed."""
    data = _slot_bytes(caches[flip.layer])
    data[flip.kv, flip.block_id, flip.offset, flip.byte_index] ^= 1 << flip.bit


def corrupt_tag(
    tags: SlotTags | torch.Tensor, block_id: int, offset: int, xor_mask: int = 0x5A5A5A5A
) -> TagCorruption:
    """XOR the tag of slot ``(block_id, offset)`` with a nonzero mask."""
    assert xor_mask != 0, "a zero mask changes nothing"
    table = tags.tags if isinstance(tags, SlotTags) else tags
    old = int(table[block_id, offset])
    table[block_id, offset] = old ^ xor_mask
    return TagCorruption(block_id, offset, old, int(table[block_id, offset]))


def redirect_block_table(
    block_table: list[int], index: int, other_block: int
) -> BlockTableRedirect:
    """Point ``block_table[index]`` at ``other_block`` (in place)."""
    old = block_table[index]
    assert old != other_block, "redirecting to the same block is not a fault"
    block_table[index] = other_block
    return BlockTableRedirect(index, old, other_block)
