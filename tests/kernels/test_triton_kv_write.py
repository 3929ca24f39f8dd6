"""The Triton KV write against the reference ``write_kv``: bytes and tags exact."""

from __future__ import annotations

import pytest
import torch

from pagewarden.kernels.attention import AttentionMetadata
from pagewarden.kernels.attention import write_kv as torch_write
from pagewarden.kernels.triton.kv_write import write_kv as triton_write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_and_tags_land_where_the_reference_puts_them(dtype, device):
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs, n_kv, d = 6, 4, 2, 8
    slots = [9, 10, 11, 12, 3, 22]  # crosses a block boundary, any order
    meta = AttentionMetadata.build([4, 1, 1], [0, 2, 5], [[2, 3], [1], [5, 4]], slots, bs, device)
    # K and V as slices of one projection, like the model's (strided token rows).
    qkv = torch.randn(len(slots), 3 * n_kv * d, generator=gen).to(device)
    k = qkv[:, : n_kv * d].view(-1, n_kv, d)
    v = qkv[:, 2 * n_kv * d :].view(-1, n_kv, d)
    tags = torch.randint(-(2**62), 2**62, (len(slots),), generator=gen).to(device)
    want = torch.zeros(2, num_blocks, bs, n_kv, d, dtype=dtype, device=device)
    got = want.clone()
    want_tags = torch.zeros(num_blocks * bs, dtype=torch.int64, device=device)
    got_tags = want_tags.clone()
    meta.new_tags, meta.slot_tags = tags, want_tags
    torch_write(want, k, v, meta)
    triton_write(got, k, v, meta.slot_mapping, tags, got_tags)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got_tags, want_tags)


def test_without_tags_writes_only_kv(device):
    cache = torch.zeros(2, 3, 4, 1, 4, device=device)
    k = torch.ones(2, 1, 4, device=device)
    triton_write(cache, k, 2 * k, torch.tensor([5, 6], device=device))
    assert cache[0, 1, 1:3].eq(1).all() and cache[1, 1, 1:3].eq(2).all()
    assert cache.count_nonzero() == 16
