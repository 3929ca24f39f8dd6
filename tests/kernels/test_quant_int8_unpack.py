"""The int8 tiles' weight decode (kernels/cpu/quant_int8_unpack.h): 16 weight rows' quant
words moved straight into the tile layout and their scales decoded 16 rows per vector, for
every kernel type. Checked through the many-row int8 GEMM at shapes where every part of
the decode runs short: an odd number of blocks / super-blocks, a last tile of fewer than
16 rows (it repeats its last row), a last group of fewer than 4 tiles; against the gguf
package's dequantize times x rounded as the kernel rounds it (float32), and against
quant_int8.cpp's multi-row loop (its own per-row decode, the same integer products)."""

from __future__ import annotations

import pytest
import torch

from pagewarden.kernels.cpu import quant as cpu_quant
from pagewarden.kernels.cpu.quant import QuantWeight
from tests.kernels.test_quant_int8_row import _guarded
from tests.models.test_cpu_quant import TYPES, needs_int8, q8_round, random_weight, reference


def _k(name: str, blocks: int) -> int:
    return blocks * cpu_quant.KERNEL_TYPES[TYPES[name]][1]


def _near(out: torch.Tensor, want: torch.Tensor) -> bool:
    """Within the bf16 rounding of the output (float32 sums in another order)."""
    return bool(((out.float() - want).abs() <= want.abs() / 256 + 1e-4 * want.abs().max()).all())


@needs_int8
@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("blocks", [1, 3, 5])
def test_unpacked_tiles_are_the_dequantized_weights(name, blocks, tiles_from):
    tiles_from(2)
    k, n, m = _k(name, blocks), 53, 7  # 4 tiles (the last of 5 rows): one short group
    w = random_weight(name, n, k, seed=blocks)
    g = torch.Generator().manual_seed(blocks)
    x = torch.randn(m, k, generator=g).bfloat16()
    exact = q8_round(x) @ reference(w).T
    out = cpu_quant.gemm(x, w, kernel="int8")
    assert _near(out, exact), (out.float() - exact).abs().max()
    tiles_from(1 << 30)  # quant_int8.cpp's loop: decode_u per row
    loop = cpu_quant.gemm(x, w, kernel="int8")
    assert _near(out, loop.float())


@needs_int8
@pytest.mark.parametrize("name", sorted(TYPES))
def test_unpacked_tiles_read_nothing_past_the_weight(name, tiles_from):
    """A weight whose last row ends where an unreadable page begins (Q6_K's d is the
    block's last 2 bytes; a short last tile repeats its last row): no fault, and the
    same output as a copy of it."""
    tiles_from(2)
    k, n = _k(name, 3), 21
    w = random_weight(name, n, k, seed=7)
    region, arr = _guarded(w.nbytes)
    arr[:] = w.data.numpy().reshape(-1)
    guarded = QuantWeight(torch.from_numpy(arr).view(w.data.shape), w.qtype, w.shape)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = cpu_quant.gemm(x, guarded, kernel="int8")
    assert torch.equal(got, cpu_quant.gemm(x, w, kernel="int8"))
    assert _near(got, q8_round(x) @ reference(w).T)
    del guarded, arr
    region.close()


@needs_int8
@pytest.mark.parametrize("rows", [2, 17])  # quant_int8.cpp's loop; the tiles
def test_gelu_tanh_fused_into_the_int8_gemm(rows, tiles_from):
    """GELU-tanh(gate) * up (Gemma's gate_up) in the int8 kernels' epilogue, float32 sums
    rounded once; ``gemv_gated`` sends a decode batch's rows there, a prefill's (no decode
    batch) to the bf16 tiles' fused epilogue when they are enough rows for the tiles, and
    leaves fewer to the GEMM + torch (None)."""
    tiles_from(3)
    w = random_weight("Q5_0", 2 * 72, 96, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
    exact = q8_round(x) @ reference(w).T
    want = torch.nn.functional.gelu(exact[:, :72], approximate="tanh") * exact[:, 72:]

    def near(out: torch.Tensor) -> bool:
        err = (out.float() - want).abs()
        return bool((err <= want.abs() / 128 + 1e-4 * want.abs().max()).all())

    ext = cpu_quant.load()
    assert near(ext.gemm(x, w.data, w.qtype, None, True, False, False, True, True))
    prefill = cpu_quant.gemv_gated(x, w, "gelu_tanh")
    if rows < ext.gelu_tiles_min_rows():
        assert prefill is None
    else:  # x and the weights rounded to bf16, not x to int8
        bf = x.float() @ reference(w).bfloat16().float().T
        exact_bf = torch.nn.functional.gelu(bf[:, :72], approximate="tanh") * bf[:, 72:]
        assert prefill is not None and prefill.shape == (rows, 72)
        err = (prefill.float() - exact_bf).abs()
        assert (err <= exact_bf.abs() / 128 + 1e-4 * exact_bf.abs().max()).all()
    with cpu_quant.decode_batch(True):
        got = cpu_quant.gemv_gated(x, w, "gelu_tanh")
    if rows < cpu_quant.INT8_DECODE_MIN_ROWS:
        assert got is None
    else:
        assert got is not None and got.shape == (rows, 72) and near(got)


@needs_int8
def test_decode_batch_logits_are_bf16_as_none(tiles_from):
    """A float_out (lm_head) weight returns float32 logits, except for a decode batch's
    int8 rows: bf16 there, as the bf16 path's lm_head returns them (the float32 logits of
    64 x 262144 cost about 1.3x the GEMM's CPU time); the values are the float32 ones
    rounded once."""
    tiles_from(3)
    w = random_weight("Q8_0", 40, 64, seed=4)
    head = QuantWeight(w.data, w.qtype, w.shape, float_out=True)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    full = cpu_quant.gemm(x, head)  # not a decode batch: bf16-decode, float32 logits
    assert full.dtype == torch.float32
    with cpu_quant.decode_batch(True):
        batch = cpu_quant.gemm(x, head)
        one = cpu_quant.gemm(x[:1], head)  # one row (the int8 GEMV): float32 still
    assert batch.dtype == torch.bfloat16 and one.dtype == torch.float32
    want = q8_round(x) @ reference(w).T
    assert _near(batch, want)
    assert torch.equal(batch, cpu_quant.gemm(x, head, kernel="int8").bfloat16())
