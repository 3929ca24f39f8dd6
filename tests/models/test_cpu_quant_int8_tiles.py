"""The many-row int8 path of the quantized GEMM (kernels/cpu/quant_int8_tiles.cpp): x
quantized to int8 per block of 32 once per call, weights decoded once per call into int8
tiles with per-block scales, vpdpbusd. For every kernel type, against the gguf package's
dequantize (``reference``) times x rounded as the kernel rounds it (``q8_round``) in
float32. Bound: |out - exact| <= |exact| / 256 + 1e-4 max|exact| (bf16 rounding of the
outputs; float32 sums in another order); SiLU outputs |exact| / 128 (polynomial exp). The
error against the unrounded x is the int8 activations' (about 1/254 of each block's largest
value per activation), as the one-row int8 kernel: tests/models/test_cpu_quant.py."""

from __future__ import annotations

import pytest
import torch

from pagewarden.kernels.cpu import quant as cpu_quant
from pagewarden.kernels.cpu.quant import QuantWeight
from tests.models.test_cpu_quant import TYPES, needs_int8, q8_round, random_weight, reference


def near(out: torch.Tensor, want: torch.Tensor, rel: float = 256) -> bool:
    top = want.abs().max()
    return bool(((out.float() - want).abs() <= want.abs() / rel + 1e-4 * top).all())


@needs_int8
@pytest.mark.parametrize("name", sorted(TYPES))
# row blocks of 4 (plain) and 3 (silu) with every remainder: 4: 2, 1, 3, 2; 3: 2, 2, 1, 1
@pytest.mark.parametrize("m", [2, 5, 19, 70])
def test_int8_tiles_match_q8_activations_times_float32_weights(name, m, tiles_from):
    tiles_from(2)
    assert cpu_quant.load().has_int8_tiles_kernel()
    k = 96 if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") else 512  # 3 blocks: a lone last one
    n = (
        2 * 72
    )  # silu: 72 gate + 72 up rows (a partial tile); plain: 144 = 9 tiles (a partial group)
    w = random_weight(name, n, k, seed=m)
    ref_w = reference(w)
    g = torch.Generator().manual_seed(m)
    wide = torch.randn(m, k + 40, generator=g).bfloat16()
    x = wide[:, 8 : 8 + k]  # strided rows (stride k + 40)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    exact = q8_round(x) @ ref_w.T
    assert near(cpu_quant.gemm(x, w, kernel="int8"), exact)
    residual = torch.randn(m, n, generator=g).bfloat16()
    assert near(cpu_quant.gemm(x, w, residual=residual, kernel="int8"), exact + residual.float())
    silu = torch.nn.functional.silu(exact[:, : n // 2]) * exact[:, n // 2 :]
    assert near(cpu_quant.gemm(x, w, silu_mul=True, kernel="int8"), silu, rel=128)
    head = cpu_quant.gemm(x, QuantWeight(w.data, w.qtype, w.shape, float_out=True), kernel="int8")
    assert head.dtype == torch.float32
    assert ((head - exact).abs() <= exact.abs() / 4096 + 1e-5 * exact.abs().max()).all()
    odd = w.rows(0, 37)  # odd N: the last tile has 5 columns
    assert near(cpu_quant.gemm(x, odd, kernel="int8"), exact[:, :37])


@needs_int8
@pytest.mark.parametrize("name", ["Q4_1", "Q6_K", "Q8_0"])
def test_int8_tiles_agree_with_the_int8_loop(name, tiles_from):
    """The tiles and quant_int8.cpp's multi-row loop: the same int8 activations and integer
    products, only the float32 summation order differs: each output is rounded to bf16 from
    two float32 sums that may differ in their last bits, so they may be one bf16 step
    (|v| / 128) apart (at |v| / 256, 4 of 120 seeds, 40 per type, failed; x was unseeded)."""
    w = random_weight(name, 200, 512, seed=3)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    tiles_from(2)
    tiles = cpu_quant.gemm(x, w, kernel="int8").float()
    tiles_from(1 << 30)
    loop = cpu_quant.gemm(x, w, kernel="int8").float()
    assert near(tiles, loop, rel=128)
    assert not torch.equal(tiles, torch.zeros_like(tiles))


@needs_int8
def test_int8_batch_accuracy_is_the_activations_rounding(tiles_from):
    """64 rows (a decode batch) in int8: the output is q8_round's product, and its distance
    from the bf16 x product is the activations' 8-bit rounding (mean relative 1e-4..1e-2)."""
    w = random_weight("Q4_1", 64, 576, seed=5)
    x = torch.randn(64, 576).bfloat16()
    ref_w = reference(w)
    out = cpu_quant.gemm(x, w, kernel="int8").float()
    assert near(out, q8_round(x) @ ref_w.T)
    plain = x.float() @ ref_w.T
    err = (out - plain).abs().mean() / plain.abs().mean()
    assert 1e-4 < err < 1e-2


def test_int8_tiles_min_rows_refuses_below_two():
    ext = cpu_quant.load()
    with pytest.raises(RuntimeError, match="int8_tiles_min_rows"):
        ext.set_int8_tiles_min_rows(1)
