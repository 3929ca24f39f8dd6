"""Sliding-window attention and soft-capping in the Triton kernel (under
TRITON_INTERPRET=1 on CPU), against the float64 reference of ``window_reference.py``
within 2e-5 (float32 caches; the kernel's tanh comes from exp), and its fused checks
under a window: tags and checksums of exactly the blocks read."""

from __future__ import annotations

import pytest
import torch

from pagewarden.kernels.attention_metadata import window_start
from pagewarden.kernels.triton.ops import TritonAttention
from pagewarden.worker.fused_checks import allocate_read_checks, element_keys, offset_keys
from pagewarden.worker.integrity import block_checksums
from tests.kernels.kernel_step import make_step
from tests.kernels.window_reference import random_step, reference_attention

TOL = {"atol": 2e-5, "rtol": 2e-5}


def _attend(step, window, softcap, scale=0.3):
    ops = TritonAttention(step.caches)
    return ops.attend(
        step.q, step.caches[0], step.meta, scale, sliding_window=window, softcap=softcap
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("block_size", "num_kv_heads", "group"), [(4, 2, 2), (16, 1, 4)])
def test_equals_the_reference(seed, block_size, num_kv_heads, group):
    step, window, softcap = random_step(
        seed, block_size=block_size, num_kv_heads=num_kv_heads, group=group, head_dim=16
    )
    got = _attend(step, window, softcap)
    torch.testing.assert_close(got.double(), reference_attention(step, 0.3, window, softcap), **TOL)


@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_splits_cover_the_window_only(num_splits, monkeypatch):
    """Decodes and a chunk with the key range split; blocks before every window are NaN."""
    from pagewarden.kernels.triton import attention as triton_attention

    monkeypatch.setattr(triton_attention, "choose_num_splits", lambda *_: num_splits)
    bs, window, ctx = 4, 9, [70, 20, 33]
    step = make_step([1, 1, 7], ctx, block_size=bs)
    for table, c in zip(step.tables, ctx):
        for lb in range(window_start(c, window) // bs):
            step.caches[0][:, table[lb]] = float("nan")
    got = _attend(step, window, 4.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference_attention(step, 0.3, window, 4.0), **TOL)


def test_fused_checks_cover_exactly_the_window_blocks():
    """Two sliding layers: a wrong tag inside a window is caught, one before it is not
    read; window blocks sum to their block checksum over both layers and count 2."""
    bs, window, q_lens, ctx = 4, 10, [1, 6], [50, 33]
    step = make_step(q_lens, ctx, block_size=bs, num_layers=2)
    step.slot_tags[step.tables[0][11] * bs + 2] += 1  # row 0, position 46: read
    step.slot_tags[step.tables[0][3] * bs + 1] += 1  # row 0, position 13: before the window
    n_kv = step.caches[0].shape[3]
    checks = allocate_read_checks(step.expected_tags, step.meta.max_blocks, n_kv, True)
    step.meta.read_checks, step.meta.slot_tags = checks, step.slot_tags
    ops = TritonAttention(step.caches, element_keys(step.caches), offset_keys(bs, "cpu"))
    for cache in step.caches:
        ops.attend(step.q, cache, step.meta, 0.25, sliding_window=window)
    assert checks.tag_faults.nonzero().tolist() == [[0, 11]]
    sums = checks.block_sums()
    for i, c in enumerate(ctx):
        first = window_start(c, window) // bs
        for lb in range(c // bs):
            if lb >= first and not (i == 0 and lb == 11):
                assert int(checks.read_layers[i, lb]) == 2
                want = block_checksums(step.caches, torch.tensor([step.tables[i][lb]]))
                assert int(sums[i, lb]) == int(want)
            elif lb < first:
                assert int(checks.read_layers[i, lb]) == 0 and int(sums[i, lb]) == 0
