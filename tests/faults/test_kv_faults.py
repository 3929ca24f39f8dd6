"""KV fault injectors change exactly what they report."""

from __future__ import annotations

import random

import torch

from pagewarden.faults.kv_faults import (
    corrupt_tag,
    flip_bit,
    flip_slot_bit,
    redirect_block_table,
    undo_bit_flip,
)
from pagewarden.worker.integrity import SlotTags


def _caches(dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 6, 4, 2, 8, generator=g).to(dtype) for _ in range(3)]


def test_flip_bit_changes_one_bit_in_named_block() -> None:
    caches = _caches()
    before = [c.clone() for c in caches]
    flip = flip_bit(caches, block_id=3, layer=1, rng=random.Random(1))
    for layer, (a, b) in enumerate(zip(before, caches)):
        diff = a.view(torch.uint8) ^ b.view(torch.uint8)
        if layer != flip.layer:
            assert not diff.any()
            continue
        diff = diff.view(2, 6, 4, -1)
        nz = diff.nonzero().tolist()
        assert nz == [[flip.kv, 3, flip.offset, flip.byte_index]]
        assert int(diff[flip.kv, 3, flip.offset, flip.byte_index]) == 1 << flip.bit
    undo_bit_flip(caches, flip)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, caches)
    )


def test_flip_slot_bit_hits_that_slot() -> None:
    caches = _caches(torch.float32)
    flip = flip_slot_bit(caches, slot=2 * 4 + 1, layer=0, rng=random.Random(2), kv=1)
    assert (flip.block_id, flip.offset, flip.kv, flip.layer) == (2, 1, 1, 0)


def test_corrupt_tag_and_redirect() -> None:
    tags = SlotTags(num_blocks=4, block_size=2)
    tags.write(torch.tensor([2, 3]), torch.tensor([11, 12]))
    fault = corrupt_tag(tags, block_id=1, offset=1)
    assert fault.old_tag == 12 and fault.new_tag == 12 ^ 0x5A5A5A5A
    assert int(tags.tags[1, 1]) == fault.new_tag
    table = [1, 2, 3]
    r = redirect_block_table(table, 1, 5)
    assert table == [1, 5, 3] and (r.index, r.old_block, r.new_block) == (1, 2, 5)
