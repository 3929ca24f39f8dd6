"""The bf16 GEMM kernel (cpu_gemm.cpp) against exact float64 products, and its use by
cpu_linear. The kernel exists only where the CPU has AVX512-BF16; elsewhere the
tests of the kernel itself skip and the fallback test checks that oneDNN takes over."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagewarden.kernels.cpu import gemm as cpu_gemm
from pagewarden.kernels.cpu import linear as cpu_linear

needs_kernel = pytest.mark.skipif(
    not cpu_gemm.available(), reason="the CPU has no AVX512-BF16 (or no compiler)"
)


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits)."""
    exp = torch.frexp(x.abs().clamp_min(1e-30))[1]
    return torch.ldexp(torch.ones_like(x), exp - 8)


def assert_within_one_ulp(out: torch.Tensor, exact: torch.Tensor) -> None:
    """out (bf16) within one bf16 ulp of the exact float64 result, everywhere."""
    err = (out.double() - exact).abs()
    bound = ulp_bf16(exact) + 1e-6
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f} bf16 ulps"


def bf16(*shape: int, scale: float = 0.1) -> torch.Tensor:
    return (torch.randn(*shape) * scale).bfloat16()


@needs_kernel
@pytest.mark.parametrize(
    "m, n, k",
    [(1, 576, 576), (3, 40, 64), (4, 16, 2), (5, 100, 64), (17, 960, 576), (64, 200, 1536)],
)
def test_gemm_and_residual_within_one_ulp_of_exact(m, n, k):
    torch.manual_seed(m * n + k)
    x, w, res = bf16(m, k), bf16(n, k), bf16(m, n, scale=1.0)
    tiles = cpu_gemm.pack_tiles(w)
    exact = x.double() @ w.double().T
    assert_within_one_ulp(cpu_gemm.gemm(x, tiles, n), exact)
    assert_within_one_ulp(cpu_gemm.gemm(x, tiles, n, residual=res), exact + res.double())


@needs_kernel
@pytest.mark.parametrize("m, half, k", [(1, 64, 64), (6, 1536, 576), (13, 32, 18)])
def test_gate_up_silu_mul_within_one_ulp_of_exact(m, half, k):
    torch.manual_seed(m + half + k)
    x, w = bf16(m, k), bf16(2 * half, k, scale=0.3)
    gate_up = x.double() @ w.double().T
    gate, up = gate_up[:, :half], gate_up[:, half:]
    exact = gate * torch.sigmoid(gate) * up
    out = cpu_gemm.gemm(x, cpu_gemm.pack_tiles(w, gate_up=True), 2 * half, act="silu")
    assert out.shape == (m, half)
    assert_within_one_ulp(out, exact)


@needs_kernel
@pytest.mark.parametrize("m, half, k", [(1, 64, 64), (6, 2048, 640), (13, 32, 18)])
def test_gate_up_gelu_tanh_mul_within_one_ulp_of_exact(m, half, k):
    torch.manual_seed(m + half + k)
    x, w = bf16(m, k), bf16(2 * half, k, scale=0.3)
    gate_up = x.double() @ w.double().T
    gate, up = gate_up[:, :half], gate_up[:, half:]
    inner = (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)
    exact = 0.5 * gate * (1 + torch.tanh(inner)) * up
    out = cpu_gemm.gemm(x, cpu_gemm.pack_tiles(w, gate_up=True), 2 * half, act="gelu_tanh")
    assert out.shape == (m, half)
    assert_within_one_ulp(out, exact)
    # Through linear_gated: the fused kernel where the layer is packed, else GEMM + torch.
    layer = torch.nn.Linear(k, 2 * half, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w)
    torch_path = cpu_linear.linear_gated(layer, x, "gelu_tanh")  # not packed: torch's gelu
    torch.testing.assert_close(torch_path.double(), exact, atol=0.02, rtol=0.02)
    cpu_linear.pack(layer, "tiles", gate_up=True)
    assert torch.equal(cpu_linear.linear_gated(layer, x, "gelu_tanh"), out)


@needs_kernel
def test_strided_rows_and_fallbacks():
    torch.manual_seed(0)
    wide, w = bf16(8, 100), bf16(48, 64)
    x = wide[:, 10:74]  # rows 100 apart
    tiles = cpu_gemm.pack_tiles(w)
    assert_within_one_ulp(cpu_gemm.gemm(x, tiles, 48), x.double() @ w.double().T)
    # What the kernel does not take, it declines (the caller's fallback runs).
    assert cpu_gemm.gemm(x.float(), tiles, 48) is None
    assert cpu_gemm.gemm(x.t().contiguous().t(), tiles, 48) is None  # columns strided
    assert not cpu_gemm.fits(bf16(16, 63))  # odd K
    assert not cpu_gemm.fits(bf16(48, 64), gate_up=True)  # halves of 24: not whole tiles
    with pytest.raises(RuntimeError, match="K"):
        cpu_gemm.gemm(bf16(2, 32), tiles, 48)  # x's K does not match the packing


def make_linear(n: int, k: int, bias: bool = False) -> nn.Linear:
    layer = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_(0, 0.1)
    return layer


@torch.inference_mode()
def test_packed_linear_routes_and_matches_f_linear():
    torch.manual_seed(1)
    packing = cpu_linear.pick_packing(torch.bfloat16, torch.device("cpu"))
    # The kernel where it builds, except on AMX CPUs (oneDNN's AMX kernels stay there).
    assert (packing == "tiles") == (cpu_gemm.available() and not cpu_linear._has_amx())
    plain, biased, gate_up = (
        make_linear(96, 64),
        make_linear(96, 64, bias=True),
        make_linear(64, 64),
    )
    x, res = bf16(5, 64), bf16(5, 96, scale=1.0)
    refs = (F.linear(x, plain.weight), F.linear(x, biased.weight, biased.bias))
    gu = F.linear(x, gate_up.weight).float()
    silu_ref = F.silu(gu[:, :32]) * gu[:, 32:]
    cpu_linear.pack(plain, packing)
    cpu_linear.pack(biased, packing)
    cpu_linear.pack(gate_up, packing, gate_up=True)
    if packing == "tiles":  # a bias sends the layer to oneDNN
        assert "gemm_tiles" in plain.__dict__ and "onednn_weight" in biased.__dict__
        assert "gemm_tiles_gate_up" in gate_up.__dict__
    for layer, ref in zip((plain, biased), refs):
        torch.testing.assert_close(cpu_linear.linear(layer, x), ref, atol=0.02, rtol=0.02)
        torch.testing.assert_close(
            cpu_linear.linear_add(layer, x, res), (ref.float() + res.float()).bfloat16(),
            atol=0.03, rtol=0.02,
        )  # fmt: skip
    torch.testing.assert_close(
        cpu_linear.linear_gated(gate_up, x, "silu").float(), silu_ref, atol=0.02, rtol=0.02
    )
    # Called plainly, an interleaved gate_up layer still computes [gate | up] in order.
    torch.testing.assert_close(cpu_linear.linear(gate_up, x).float(), gu, atol=0.02, rtol=0.02)
