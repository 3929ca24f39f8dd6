"""The fused CPU ops (kernels/cpu/fused.cpp) against their plain-torch references.

float32: bitwise the torch path for every op. bfloat16: RMSNorm bitwise the torch path;
RoPE and SiLU*mul bitwise the float32 reference rounded once (the torch path rounds after
each op, so it may differ from them). The extension must build here: a test that fell
back to the reference would compare the reference with itself.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pagewarden.kernels.cpu import fused as cpu_fused
from pagewarden.kernels.cpu import linear as cpu_linear
from pagewarden.models.llama import LlamaConfig, LlamaForCausalLM

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ext():
    ext = cpu_fused.load()
    assert ext is not None, "the C++ extension did not build (see the log line)"
    return ext


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = (bits(got) != bits(want)).sum().item()
    assert diff == 0, f"{diff} of {want.numel()} elements differ"


def strided_rows(t: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """(t, n) with a row stride of n + 3, as a slice of a wider projection is."""
    return (torch.randn(t, n + 3, generator=gen) * 2).to(dtype)[:, 1 : n + 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 576), (64, 576), (3, 7), (5, 17), (2, 100), (4, 4100)])
def test_rms_norm_is_bitwise_the_torch_path(ext, dtype, t, h):
    gen = torch.Generator().manual_seed(t * h)
    w = (torch.rand(h, generator=gen) + 0.5).to(dtype)
    for x in (torch.randn(t, h, generator=gen).to(dtype), strided_rows(t, h, dtype, gen)):
        assert_bitwise(ext.rms_norm(x, w, 1e-5), cpu_fused.rms_norm_reference(x, w, 1e-5))
    # Rows past the cascade's first level (power-of-two chunks) and wide-ranging values.
    x = (torch.randn(t, h, generator=gen) * torch.logspace(-3, 3, h)).to(dtype)
    assert_bitwise(ext.rms_norm(x, w, 1e-6), cpu_fused.rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("t,h", [(1, 640), (64, 640), (3, 7), (4, 256)])
def test_rms_norm_of_bf16_rows_by_a_float32_weight_is_bitwise_the_torch_path(ext, t, h):
    """Gemma's (1 + w) stays float32; the bf16 rows are normalised in float32 against it."""
    gen = torch.Generator().manual_seed(t + h)
    w = torch.rand(h, generator=gen) + 0.5  # float32
    for x in (torch.randn(t, h, generator=gen).bfloat16(), strided_rows(t, h, torch.bfloat16, gen)):
        want = cpu_fused.rms_norm_reference(x, w, 1e-6)
        assert_bitwise(ext.rms_norm(x, w, 1e-6), want)
        assert_bitwise(cpu_fused.rms_norm(x, w, 1e-6), want)


@pytest.mark.parametrize(
    "dtype,wdtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize(
    "t,n_q,n_kv,d", [(1, 4, 1, 256), (64, 4, 1, 256), (3, 6, 2, 8), (2, 2, 2, 80)]
)
def test_rms_norm_heads_normalises_q_and_k_in_place_bitwise(ext, dtype, wdtype, t, n_q, n_kv, d):
    gen = torch.Generator().manual_seed(t * n_q * d)
    qkv = (torch.randn(t, (n_q + 2 * n_kv) * d, generator=gen) * 3).to(dtype)  # [q k | v]
    qk = qkv[:, : (n_q + n_kv) * d].view(t, n_q + n_kv, d)
    w_q = (torch.rand(d, generator=gen) + 0.5).to(wdtype)
    w_k = (torch.rand(d, generator=gen) + 0.5).to(wdtype)
    want = torch.cat(
        (
            cpu_fused.rms_norm_reference(qk[:, :n_q].reshape(-1, d), w_q, 1e-6).view(t, n_q, d),
            cpu_fused.rms_norm_reference(qk[:, n_q:].reshape(-1, d), w_k, 1e-6).view(t, n_kv, d),
        ),
        dim=1,
    )
    assert_bitwise(cpu_fused.rms_norm_heads_reference(qk.clone(), w_q, w_k, n_q, 1e-6), want)
    before = qkv.clone()
    out = cpu_fused.rms_norm_heads(qk, w_q, w_k, n_q, 1e-6)
    assert out.data_ptr() == qk.data_ptr()  # in place
    assert_bitwise(qk, want)
    assert torch.equal(qkv[:, (n_q + n_kv) * d :], before[:, (n_q + n_kv) * d :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,heads,d", [(1, 12, 64), (64, 12, 64), (3, 5, 80), (2, 3, 8), (5, 2, 6)])
def test_rope_rotates_in_place_as_the_reference_does(ext, dtype, t, heads, d):
    gen = torch.Generator().manual_seed(t * heads * d)
    qkv = torch.randn(t, (heads + 2) * d, generator=gen).to(dtype)  # [q k | v]
    qk = qkv[:, : heads * d].view(t, heads, d)
    cos = torch.randn(t, 1, d, generator=gen).to(dtype)
    sin = torch.randn(t, 1, d, generator=gen).to(dtype)
    want = cpu_fused.rope_reference(qk.float(), cos.float(), sin.float()).to(dtype)
    if dtype == torch.float32:
        assert_bitwise(want, cpu_fused.rope_reference(qk, cos, sin))
    before = qkv.clone()
    out = ext.rope_(qk, cos, sin)
    assert out.data_ptr() == qk.data_ptr()
    assert_bitwise(qk, want)
    assert torch.equal(qkv[:, heads * d :], before[:, heads * d :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", [(1, 1536), (64, 1536), (3, 37), (5, 16), (2, 100), (9, 64)])
def test_silu_mul_is_the_reference_rounded_once(ext, dtype, t, i):
    gen = torch.Generator().manual_seed(t * i)
    for gate_up in (
        (torch.randn(t, 2 * i, generator=gen) * 4).to(dtype),
        strided_rows(t, 2 * i, dtype, gen),
    ):
        got = ext.silu_mul(gate_up)
        assert got.is_contiguous()
        assert_bitwise(got, cpu_fused.silu_mul_reference(gate_up.float()).to(dtype))
        if dtype == torch.bfloat16:  # the torch path rounds twice: at most one ulp apart
            ulps = (bits(got).int() - bits(cpu_fused.silu_mul_reference(gate_up)).int()).abs()
            assert ulps.max() <= 1


def test_wrappers_take_the_torch_path_where_the_kernels_do_not_apply(ext):
    x = torch.randn(4, 8, dtype=torch.float64)
    w = torch.rand(8, dtype=torch.float64)
    torch.testing.assert_close(
        cpu_fused.rms_norm(x, w, 1e-6), cpu_fused.rms_norm_reference(x, w, 1e-6)
    )
    qk = torch.randn(2, 3, 10)[:, :, :8]  # (T, NH, D) with heads 10 apart: rows not dense
    cos, sin = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    before = qk.clone()
    out = cpu_fused.rope(qk, cos, sin)
    assert torch.equal(qk, before) and out.data_ptr() != qk.data_ptr()
    assert torch.equal(out, cpu_fused.rope_reference(before, cos, sin))
    w = torch.ones(8, requires_grad=True)  # autograd wanted: the torch path records it
    assert cpu_fused.rms_norm(torch.randn(2, 8), w, 1e-6).requires_grad


@pytest.fixture
def no_ext(monkeypatch):
    """cpu_fused as a fresh process with PAGEWARDEN_NO_CPU_EXT=1 sees it."""
    monkeypatch.setenv(cpu_fused.DISABLE_ENV, "1")
    monkeypatch.setattr(cpu_fused, "_tried", False)
    monkeypatch.setattr(cpu_fused, "_ext", None)


def test_disabled_by_env_the_torch_path_runs(no_ext, caplog):
    with caplog.at_level(logging.INFO, logger=cpu_fused.__name__):
        assert cpu_fused.load() is None
    assert cpu_fused.DISABLE_ENV in caplog.text
    gate_up = torch.randn(3, 10, dtype=torch.bfloat16)
    assert torch.equal(cpu_fused.silu_mul(gate_up), cpu_fused.silu_mul_reference(gate_up))


def test_a_failed_build_logs_once_and_falls_back(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def fail(**kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.delenv(cpu_fused.DISABLE_ENV, raising=False)
    monkeypatch.setattr(cpu_fused, "_tried", False)
    monkeypatch.setattr(cpu_fused, "_ext", None)
    monkeypatch.setattr(cpp_extension, "load", fail)
    with caplog.at_level(logging.WARNING, logger=cpu_fused.__name__):
        assert cpu_fused.load() is None
        assert cpu_fused.load() is None
    assert caplog.text.count("Ninja is required") == 1
    x, w = torch.randn(2, 8), torch.rand(8)
    assert torch.equal(cpu_fused.rms_norm(x, w, 1e-6), cpu_fused.rms_norm_reference(x, w, 1e-6))


def tiny_model(dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.storage_dtype = torch.float32
    model.use_compute_dtype(dtype)
    return model


class CountingExt:
    """The extension, counting calls per op."""

    def __init__(self, ext) -> None:
        self.ext, self.calls = ext, {"rms_norm": 0, "rope_": 0, "silu_mul": 0}

    def __getattr__(self, name):
        fn = getattr(self.ext, name)

        def counted(*args):
            self.calls[name] += 1
            return fn(*args)

        return counted


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_layers_run_the_fused_ops(ext, monkeypatch, dtype):
    from pagewarden.kernels.attention import AttentionMetadata

    model = tiny_model(dtype)
    ids = torch.tensor([3, 9, 27, 1, 5])
    meta = AttentionMetadata.build([5], [0], [[1, 2]], list(range(4, 9)), 4, "cpu")
    caches = [torch.zeros(2, 3, 4, 2, 8, dtype=dtype) for _ in range(2)]

    counting = CountingExt(ext)
    monkeypatch.setattr(cpu_fused, "_ext", counting)
    fused = model(ids, torch.arange(5), caches, meta)
    # In bf16 on AVX512-BF16, SiLU*mul runs inside the gate_up GEMM (cpu_gemm) instead.
    cpu = torch.device("cpu")
    in_gemm = dtype == torch.bfloat16 and cpu_linear.pick_packing(dtype, cpu) == "tiles"
    assert counting.calls == {"rms_norm": 5, "rope_": 2, "silu_mul": 0 if in_gemm else 2}

    monkeypatch.setattr(cpu_fused, "_ext", None)  # the torch path
    plain = model(ids, torch.arange(5), [c.clone().zero_() for c in caches], meta)
    if dtype == torch.float32:
        assert_bitwise(fused, plain)
    else:  # RoPE and SiLU*mul round once: close, not equal
        torch.testing.assert_close(fused, plain, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s,v", [(1, 262144), (64, 1000), (3, 7), (5, 17)])
def test_argmax_is_the_first_maximum_as_torch_max(ext, dtype, s, v):
    gen = torch.Generator().manual_seed(s * v)
    x = (torch.randn(s, v + 5, generator=gen) * 4).to(dtype)[:, 2 : v + 2]  # strided rows
    x[0, v // 2] = x[0, v - 1] = x[0].max() + 1  # a tie: the first one wins
    if s > 2:
        x[1, 3 % v] = float("nan")  # a NaN is the maximum, as torch's max has it
        x[2] = 0.0  # all equal
    want = x.max(dim=-1).indices
    assert torch.equal(ext.argmax_rows(x), want)
    assert torch.equal(cpu_fused.argmax(x), want)


def test_gemma_layers_run_the_fused_norms(ext, monkeypatch):
    """Gemma's (1 + w) norms (float32 factors under bf16 rows), post-norms with their
    residual add and q/k norms run in the extension;
    bitwise the torch path in float32, close to it in bfloat16 (RoPE rounds once)."""
    from pagewarden.kernels.attention import AttentionMetadata
    from pagewarden.models.gemma import GemmaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, hidden_act="gelu_tanh",
        norm_offset=1.0, qk_norm=True, embed_scale=True, query_pre_attn_scalar=16,
    )  # fmt: skip
    ids = torch.tensor([3, 9, 27, 1, 5])
    meta = AttentionMetadata.build([5], [0], [[1, 2]], list(range(4, 9)), 4, "cpu")
    for dtype in DTYPES:
        torch.manual_seed(0)
        model = GemmaForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.3)
        model.storage_dtype = torch.float32
        model.use_compute_dtype(dtype)
        caches = [torch.zeros(2, 3, 4, 1, 16, dtype=dtype) for _ in range(2)]
        counting = CountingExt(ext)
        counting.calls.update(rms_norm_heads_=0, rms_norm_add=0)
        monkeypatch.setattr(cpu_fused, "_ext", counting)
        fused = model(ids, torch.arange(5), caches, meta)
        # a layer: 2 pre-norms, 2 post-norms with their residual add, 1 q/k norm call
        calls = counting.calls
        assert (calls["rms_norm"], calls["rms_norm_add"], calls["rms_norm_heads_"]) == (5, 4, 2)
        monkeypatch.setattr(cpu_fused, "_ext", None)  # the torch path
        plain = model(ids, torch.arange(5), [c.clone().zero_() for c in caches], meta)
        if dtype == torch.float32:
            assert_bitwise(fused, plain)
        else:
            torch.testing.assert_close(fused, plain, atol=0.1, rtol=0.05)


@pytest.mark.parametrize(
    "dtype,wdtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize("t,h", [(1, 640), (64, 640), (3, 7), (5, 17)])
def test_rms_norm_add_is_bitwise_the_norm_then_the_add(ext, dtype, wdtype, t, h):
    """Gemma's post-norms: residual + norm(x), the norm rounded first, as torch rounds it."""
    gen = torch.Generator().manual_seed(t * h + 1)
    w = (torch.rand(h, generator=gen) + 0.5).to(wdtype)
    res = strided_rows(t, h, dtype, gen)
    for x in (torch.randn(t, h, generator=gen).to(dtype), strided_rows(t, h, dtype, gen)):
        want = res + cpu_fused.rms_norm_reference(x, w, 1e-6)
        assert_bitwise(ext.rms_norm_add(x, w, res, 1e-6), want)
        assert_bitwise(cpu_fused.rms_norm_add(x, w, res, 1e-6), want)
