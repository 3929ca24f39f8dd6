"""Sliding-window attention and soft-capping on the cpu backend (the C++ decode and
fresh-prompt kernels, the torch path for chunks), and its read checks under a window.

Every output is compared with the float64 reference of ``window_reference.py``: float32
caches within 2e-5 (the kernels' exp and tanh are polynomials of a few ulp), bfloat16
within 2e-2 absolute and relative (the output is rounded to bf16, 2^-8). A sliding
layer must read only the blocks of its window: blocks before it are poisoned with NaN
and never show up; the checks cover exactly the blocks read.
"""

from __future__ import annotations

import pytest
import torch

from pagewarden.kernels.attention_metadata import window_start
from pagewarden.kernels.cpu import attention as cpu_attention
from pagewarden.worker.fused_checks import allocate_read_checks, limb_keys, offset_keys
from pagewarden.worker.integrity import block_checksums
from tests.kernels.kernel_step import make_step
from tests.kernels.window_reference import random_step, reference_attention

assert cpu_attention.load_extension() is not None, cpu_attention.unavailable_reason()

F32 = {"atol": 2e-5, "rtol": 2e-5}
BF16 = {"atol": 2e-2, "rtol": 2e-2}


def _attend(step, window, softcap, scale=0.3, layer=0):
    ops = cpu_attention.CpuAttention(step.caches)
    cache = step.caches[layer]
    return ops.attend(step.q, cache, step.meta, scale, sliding_window=window, softcap=softcap)


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "group", "head_dim"),
    [(4, 2, 2, 16), (16, 1, 4, 8), (8, 3, 3, 64), (16, 2, 1, 128)],
)
def test_float32_equals_the_reference(seed, block_size, num_kv_heads, group, head_dim):
    step, window, softcap = random_step(
        seed, block_size=block_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim
    )
    got = _attend(step, window, softcap)
    torch.testing.assert_close(got.double(), reference_attention(step, 0.3, window, softcap), **F32)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 2, 128), (2, 1, 16), (1, 4, 256)]
)
def test_bfloat16_equals_the_reference(seed, num_kv_heads, group, head_dim):
    step, window, softcap = random_step(
        seed, block_size=8, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
        dtype=torch.bfloat16,
    )  # fmt: skip
    got = _attend(step, window, softcap)
    torch.testing.assert_close(
        got.double(), reference_attention(step, 0.3, window, softcap), **BF16
    )


@pytest.mark.parametrize(
    ("window", "softcap"), [(5, None), (16, None), (20, 2.0), (1, None), (37, 0.5), (None, 3.0)]
)
def test_fresh_prompts_across_query_tiles(window, softcap):
    """The fresh-prompt kernel (bf16, AVX512-BF16): prompts of 37, 16 and 17 tokens over
    several 16-query tiles, windows inside a tile, on a tile edge, across tiles."""
    step = make_step([37, 16, 1, 17, 37], [0, 0, 30, 0, 0], num_kv_heads=3, group=3,
                     head_dim=64, dtype=torch.bfloat16)  # fmt: skip
    got = _attend(step, window, softcap, scale=0.125)
    want = reference_attention(step, 0.125, window, softcap)
    torch.testing.assert_close(got.double(), want, **BF16)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("window", [1, 6, 13, 40])
def test_split_decode_reads_only_the_window(num_splits, window, monkeypatch):
    """Decode rows split across threads over their window's blocks only: blocks before
    every window are NaN, and the output is finite and equal to the reference."""
    monkeypatch.setattr(cpu_attention, "choose_num_splits", lambda *_: num_splits)
    bs, ctx = 4, [70, 20, 3]
    step = make_step([1, 1, 1], ctx, block_size=bs, num_kv_heads=3, group=3, head_dim=64)
    for table, c in zip(step.tables, ctx):
        for lb in range(window_start(c, window) // bs):
            step.caches[0][:, table[lb]] = float("nan")
    got = _attend(step, window, 2.0, scale=0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference_attention(step, 0.125, window, 2.0), **F32)


def test_chunks_read_only_the_window():
    bs, window, ctx = 4, 7, [33, 12]
    step = make_step([9, 5], ctx, block_size=bs)
    for table, c in zip(step.tables, ctx):
        for lb in range(window_start(c, window) // bs):
            step.caches[0][:, table[lb]] = float("nan")
    got = _attend(step, window, None)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference_attention(step, 0.3, window, None), **F32)


def test_off_is_bit_identical_to_no_arguments():
    step = make_step([1, 1, 6, 1, 3], [50, 15, 33, 0, 0], dtype=torch.bfloat16, head_dim=64)
    ops = cpu_attention.CpuAttention(step.caches)
    a = ops.attend(step.q, step.caches[0], step.meta, 0.3)
    b = ops.attend(step.q, step.caches[0], step.meta, 0.3, sliding_window=None, softcap=None)
    assert torch.equal(a, b)


# Decode rows 0, 1 and a chunk (row 2) over cached prefixes, a fresh prompt (row 3).
Q_LENS, CTX = [1, 1, 6, 5], [50, 9, 33, 0]
WINDOW, BS = 10, 4  # row 0 reads from position 41 (block 10), row 2 from 24 (block 6)


def _read(step, window, checksums=True):
    """One attend per layer with a sliding window; returns the shared ReadChecks."""
    n_kv = step.caches[0].shape[3]
    step.meta.read_checks = allocate_read_checks(
        step.expected_tags, step.meta.max_blocks, n_kv, checksums
    )
    ops = cpu_attention.CpuAttention(step.caches, limb_keys(step.caches), offset_keys(BS, "cpu"))
    for cache in step.caches:
        ops.attend(step.q, cache, step.meta, 0.25, sliding_window=window)
    return step.meta.read_checks


def test_tags_are_checked_for_the_blocks_read_and_only_those():
    """A wrong tag inside a row's window is caught in the block that read it; one in a
    block before every window is not read, so not reported (no token depends on it)."""
    step = make_step(Q_LENS, CTX, block_size=BS)
    tags = step.slot_tags
    tags[step.tables[0][11] * BS + 2] += 1  # row 0, position 46: inside its window
    tags[step.tables[0][3] * BS + 1] += 1  # row 0, position 13: before it
    tags[step.tables[2][6] * BS + 3] += 1  # row 2, position 27: inside the chunk's window
    tags[step.tables[2][2] * BS + 0] += 1  # row 2, position 8: before it
    tags[step.tables[3][1] * BS + 0] += 1  # fresh row 3, position 4: its own new K/V
    checks = _read(step, WINDOW, checksums=False)
    assert checks.tag_faults.nonzero().tolist() == [[0, 11], [2, 6], [3, 1]]
    step.meta.read_checks = None
    assert _read(step, None, checksums=False).tag_faults.nonzero().tolist() == [
        [0, 3], [0, 11], [2, 2], [2, 6], [3, 1],
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksums_and_layer_counts_cover_exactly_the_blocks_read(dtype):
    """Two sliding layers: every context block a window touches sums to its block
    checksum and counts 2 layers; blocks before the windows count 0 and sum nothing."""
    step = make_step(Q_LENS, CTX, block_size=BS, num_layers=2, dtype=dtype)
    checks = _read(step, WINDOW)
    assert checks.read_layers is not None and not checks.tag_faults.any()
    sums = checks.block_sums()
    for i, ctx in enumerate(CTX):
        first = window_start(ctx, WINDOW) // BS
        for lb in range(ctx // BS):  # full context blocks
            block = torch.tensor([step.tables[i][lb]])
            if lb >= first:
                assert int(checks.read_layers[i, lb]) == 2
                assert int(sums[i, lb]) == int(block_checksums(step.caches, block))
            else:
                assert int(checks.read_layers[i, lb]) == 0 and int(sums[i, lb]) == 0
