"""The token-bitmask kernels (the fused C++ op and xgrammar's CPU kernel) against its plain-torch reference:
listed rows masked exactly, other rows untouched, strided logits and padded words."""

from __future__ import annotations

import pytest
import torch

from pagewarden.kernels.cpu import fused as cpu_fused
from pagewarden.kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_reference_


@pytest.mark.parametrize("kernel", ["fused", "xgrammar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_the_reference(dtype, kernel, monkeypatch):
    if kernel == "fused":
        assert cpu_fused.load() is not None, "the fused CPU ops must build here"
    else:  # the fallback where the fused op is not built
        monkeypatch.setattr(cpu_fused, "mask_rows_", lambda *a: False)
    g = torch.Generator().manual_seed(0)
    vocab, width = 1000, 40  # 40 words cover 1280 tokens: the last words are padding
    wide = torch.randn(6, vocab + 24, generator=g).to(dtype)
    bits = torch.randint(-(2**31), 2**31 - 1, (6, width), generator=g, dtype=torch.int32)
    bits[2, 0] = -1  # every bit, bit 31 included
    bits[4] = 0  # nothing allowed
    rows = [0, 2, 4, 5]
    for logits in (wide[:, :vocab], wide[:, :vocab].contiguous()):  # strided and not
        fast, ref = logits.clone(), logits.clone()
        apply_token_bitmask_(fast, bits, rows)
        apply_token_bitmask_reference_(ref, bits, rows)
        assert torch.equal(fast, ref)
        assert torch.equal(fast[[1, 3]], logits[[1, 3]])  # rows not listed: unchanged
        assert torch.isinf(fast[4]).all() and torch.equal(fast[2, :32], logits[2, :32])
        t = 999  # the last real token: bit 7 of word 31
        assert (fast[0, t] == float("-inf")) != bool((int(bits[0, 31]) >> 7) & 1)


def test_the_reference_masks_by_bit():
    logits = torch.zeros(2, 40)
    bits = torch.zeros(2, 2, dtype=torch.int32)
    bits[1, 0] = (1 << 3) | -(2**31)  # tokens 3 and 31
    bits[1, 1] = 1 << 1  # token 33
    apply_token_bitmask_reference_(logits, bits, [1])
    assert torch.equal(logits[0], torch.zeros(40))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3, 31, 33]


def test_narrow_bitmask_is_refused():
    with pytest.raises(AssertionError, match="narrower"):
        apply_token_bitmask_(torch.zeros(1, 65), torch.zeros(1, 2, dtype=torch.int32), [0])
