"""The one-row int8 GEMV of kernels/cpu/quant_int8_row.h (a single stream's decode step):
odd shapes of the 4-blocks-per-step Q4_0 / Q4_1 path, and no read past a weight's last
byte (the weight placed against a page that cannot be read), for every type."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
import torch

from pagewarden.kernels.cpu import quant as cpu_quant
from pagewarden.kernels.cpu.quant import QuantWeight
from tests.models.test_cpu_quant import TYPES, needs_int8, q8_round, random_weight, reference

pytest.importorskip("gguf")


def expected(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return q8_round(x) @ reference(w).T  # what the int8 kernel computes, in float32


def _outputs(x: torch.Tensor, w: QuantWeight, residual: torch.Tensor) -> dict[str, torch.Tensor]:
    """The int8 GEMV's float32 logits, residual add and (even rows) SiLU*up outputs."""
    head = QuantWeight(w.data, w.qtype, w.shape, float_out=True)
    out = {
        "head": cpu_quant.gemm(x, head, kernel="int8"),
        "res": cpu_quant.gemm(x, w, residual=residual, kernel="int8").float(),
    }
    if w.shape[0] % 2 == 0:
        out["silu"] = cpu_quant.gemm(x, w, silu_mul=True, kernel="int8").float()
    return out


@needs_int8
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_four_block_steps_at_odd_block_and_row_counts(name, monkeypatch):
    """(Q8_0: quant_int8_row.h's quads8, three loads per 4 blocks.) K of 1 to 5 blocks and 17, 18 (a short last step of 1, 2 or 3 blocks, or none);
    rows not a multiple of the 8 per pass; residual and SiLU*up epilogues. Against the
    multi-row loop (PAGEWARDEN_INT8_ROW=0: the same int8 activations and integer products,
    another float32 summation order) and the float32 product of the int8-rounded x."""
    for k in (32, 64, 96, 128, 160, 544, 576, 640):
        for n in (1, 7, 9, 18):
            w = random_weight(name, n, k, seed=n * k)
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(k + n)).bfloat16()
            residual = torch.randn(1, n).bfloat16()
            row = _outputs(x, w, residual)
            monkeypatch.setenv("PAGEWARDEN_INT8_ROW", "0")
            loop = _outputs(x, w, residual)
            monkeypatch.delenv("PAGEWARDEN_INT8_ROW")
            exact = expected(x, w)
            top = exact.abs().max()
            assert (row["head"] - loop["head"]).abs().max() <= 1e-5 * top, (k, n)
            assert (row["head"] - exact).abs().max() <= 0.01 * top, (k, n)  # rare rounding ties
            for key in ("res", "silu"):
                if key in row:  # one bf16 step of the output
                    step = loop[key].abs() / 128 + 1e-4 * top
                    assert ((row[key] - loop[key]).abs() <= step).all(), (k, n, key)


# (bytes per block, offset, length) of the bits under test: Q5_0 / Q5_1 qh (the fifth bits,
# picked per lane by a bit shuffle), Q4_K / Q5_K's 12 bytes of 6-bit scales and mins
# (unpacked in one register).
_BITS = {"Q5_0": (22, 2, 4), "Q5_1": (24, 4, 4), "Q4_K": (144, 4, 12), "Q5_K": (176, 4, 12)}


@needs_int8
@pytest.mark.parametrize("name", sorted(_BITS))
def test_fifth_bits_and_k_scales_at_every_bit_pattern(name):
    """The one-row GEMV with the bytes under test (``_BITS``) set to all ones, alternating
    bits, single halves and random bytes, block by block: its float32 logits within 1e-4
    of the largest of q8(x) @ the gguf package's dequantized weight (float32): the kernel
    uses the weights exactly, so only the float32 summation order differs."""
    block_bytes, at, size = _BITS[name]
    per_block = cpu_quant.KERNEL_TYPES[TYPES[name]][1]
    patterns = [0xFF, 0xAA, 0x55, 0xC0, 0x3F, 0x0F, 0xF0, 0x00]
    n, k = 12, 8 * per_block if per_block == 32 else 3 * per_block
    w = random_weight(name, n, k, seed=7)
    data = w.data.clone().view(n, -1, block_bytes)  # (n, blocks, block_bytes)
    rng = np.random.default_rng(0)
    for r in range(n):
        for b in range(data.shape[1]):
            i = (r * data.shape[1] + b) % (len(patterns) + 1)
            fill = rng.integers(0, 256, size) if i == len(patterns) else [patterns[i]] * size
            data[r, b, at : at + size] = torch.tensor(fill, dtype=torch.uint8)
    w = QuantWeight(data.view(n, -1), w.qtype, w.shape, float_out=True)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    exact = expected(x, w)
    got = cpu_quant.gemm(x, w, kernel="int8")
    assert got.dtype == torch.float32
    assert (got - exact).abs().max() <= 1e-4 * exact.abs().max()


def _guarded(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """A writable uint8 array of ``nbytes`` whose last byte is the last of a page, the next
    page unreadable (a read past the end faults)."""
    page = mmap.PAGESIZE
    pages = (nbytes + page - 1) // page
    region = mmap.mmap(-1, (pages + 1) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(ctypes.c_void_p(base + pages * page), page, 0) == 0  # PROT_NONE
    arr = np.frombuffer(region, np.uint8, count=nbytes, offset=pages * page - nbytes)
    return region, arr


@needs_int8
@pytest.mark.parametrize("name", sorted(TYPES))
def test_one_row_gemv_reads_nothing_past_the_weight(name):
    """The last row's last blocks are read with masked loads: a weight that ends where an
    unreadable page begins computes (no fault) the same as a copy of it."""
    per_block = cpu_quant.KERNEL_TYPES[TYPES[name]][1]
    for k in (544, 96) if per_block == 32 else (256, 512):
        n = 10
        w = random_weight(name, n, k, seed=k)
        region, arr = _guarded(w.nbytes)
        arr[:] = w.data.numpy().reshape(-1)
        guarded = QuantWeight(torch.from_numpy(arr).view(w.data.shape), w.qtype, w.shape)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).bfloat16()
        residual = torch.randn(1, n).bfloat16()
        for kwargs in ({}, {"residual": residual}, {"silu_mul": True}):
            got = cpu_quant.gemm(x, guarded, kernel="int8", **kwargs)
            assert torch.equal(got, cpu_quant.gemm(x, w, kernel="int8", **kwargs)), (k, kwargs)
        del guarded, arr


@needs_int8
def test_auto_rule_for_one_bf16_row_is_decided_in_cpp():
    """``gemm``'s kernel="auto" for one bf16 row goes through the extension's gemv_auto
    (checks in C++): the int8 GEMV's outputs exactly; None where the rule does not apply."""
    ext = cpu_quant.load()
    w = random_weight("Q4_1", 6, 96, seed=3)
    x = torch.randn(1, 96).bfloat16()
    residual = torch.randn(1, 6).bfloat16()
    head = QuantWeight(w.data, w.qtype, w.shape, float_out=True)
    assert torch.equal(cpu_quant.gemm(x, w), cpu_quant.gemm(x, w, kernel="int8"))
    assert cpu_quant.gemm(x, head).dtype == torch.float32
    assert torch.equal(cpu_quant.gemm(x, head), cpu_quant.gemm(x, head, kernel="int8"))
    for kwargs in ({"residual": residual}, {"silu_mul": True}):
        want = cpu_quant.gemm(x, w, kernel="int8", **kwargs)
        assert torch.equal(cpu_quant.gemm(x, w, **kwargs), want)
        assert torch.equal(cpu_quant.gemm(x, head, **kwargs), want)  # logits only alone
    for other in (torch.randn(2, 96).bfloat16(), x.float(), torch.randn(96, 2).bfloat16().t()[:1]):
        assert ext.gemv_auto(other, w.data, w.qtype, None, False, False) is None
    assert ext.gemv_auto(x, w.data, w.qtype, residual.float(), False, False) is None
    mixed = cpu_quant.gemm(x, w, residual=residual.float())  # the general path converts
    assert torch.equal(mixed, cpu_quant.gemm(x, w, residual=residual, kernel="int8"))


@needs_int8
@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_gelu_tanh_gate_fused_into_the_one_row_gemv(name):
    """gemv_gated(x, [gate; up], "gelu_tanh") = torch's gelu(approximate="tanh")(gate) * up
    on the int8 GEMV's float32 sums, rounded once to bf16 (gate/up rows not a multiple of
    the rows per pass); "silu" is gemm's silu_mul exactly; None for 2 rows (no fused path)."""
    per_block = cpu_quant.KERNEL_TYPES[TYPES[name]][1]
    for k in (544, 96) if per_block == 32 else (256, 512):
        for n in (2, 14, 38):
            w = random_weight(name, n, k, seed=n + k)
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).bfloat16()
            exact = expected(x, w)
            top = exact.abs().max()
            gate, up = exact[:, : n // 2], exact[:, n // 2 :]
            want = torch.nn.functional.gelu(gate, approximate="tanh") * up
            got = cpu_quant.gemv_gated(x, w, "gelu_tanh")
            assert got is not None and got.shape == (1, n // 2) and got.dtype == torch.bfloat16
            # one bf16 step of the output, plus the sums' rare int8 rounding ties
            assert ((got.float() - want).abs() <= want.abs() / 128 + 0.01 * top * top).all(), (k, n)
            silu = cpu_quant.gemv_gated(x, w, "silu")
            assert torch.equal(silu, cpu_quant.gemm(x, w, silu_mul=True, kernel="int8"))
            assert cpu_quant.gemv_gated(torch.cat([x, x]), w, "gelu_tanh") is None


@needs_int8
def test_quant_rows_one_row_in_one_call():
    """A ``QuantRows`` weight (Q5_0, Q8_0 and Q4_K row ranges over one K, as Gemma 3's mixed
    q/k/v) against one bf16 row: ``gemm`` runs every part in one extension call
    (``gemv_parts``) into one output, equal to each part's own int8 GEMV side by side, with
    and without a residual; against the gguf package's dequantize times the int8-rounded x
    in float32 within a bf16 step; None (the per-part path) for two rows."""
    from pagewarden.kernels.cpu.quant import QuantRows

    k = 512
    parts = [random_weight("Q5_0", 12, k, 1), random_weight("Q8_0", 5, k, 2)]
    parts.append(random_weight("Q4_K", 3, k, 3))
    rows = QuantRows(tuple(parts))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    residual = torch.randn(1, 20, generator=torch.Generator().manual_seed(6)).bfloat16()
    for res in (None, residual):
        got = cpu_quant.gemm(x, rows, residual=res)
        cols, start = [], 0
        for p in parts:
            r = None if res is None else res[:, start : start + p.shape[0]]
            cols.append(cpu_quant.gemm(x, p, residual=r, kernel="int8"))
            start += p.shape[0]
        assert got.shape == (1, 20) and torch.equal(got, torch.cat(cols, dim=-1))
        exact = torch.cat([expected(x, p) for p in parts], dim=-1)
        if res is not None:
            exact = exact + res.float()
        step = exact.abs() / 128 + 1e-3 * exact.abs().max()
        assert ((got.float() - exact).abs() <= step).all()
    ext = cpu_quant.load()
    two = torch.randn(2, k).bfloat16()
    assert ext.gemv_parts(two, [p.data for p in parts], [p.qtype for p in parts], None) is None
    assert cpu_quant.gemm(two, rows).shape == (2, 20)
