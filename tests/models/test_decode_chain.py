"""models/decode_chain: a one-token decode step's layers chained in C++ give the per-layer
path's results bit for bit (the same kernels on the same bytes), and the chain is used
only where it applies."""

from __future__ import annotations

import pytest
import torch

from pagewarden.kernels.cpu import fused as cpu_fused
from pagewarden.kernels.cpu import quant as cpu_quant
from pagewarden.models import decode_chain
from pagewarden.models.decode_chain import DecodeChain
from tests.models.test_cpu_quant import random_weight

ext = cpu_quant.load()
pytestmark = pytest.mark.skipif(
    ext is None or not ext.has_decode_chain(), reason="no int8 GEMV or fused norm in this build"
)

H, Q, N = 256, 256, 512  # hidden, attention width, intermediate (K-quants: multiples of 256)


def _norm_weight(dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)


def _gemv(x, w, residual=None, act=0):
    out = ext.gemv_auto(x, w.data, w.qtype, residual, act, False)
    assert out is not None
    return out


@pytest.mark.parametrize("norm_dtype", [torch.bfloat16, torch.float32])
def test_head_is_the_norm_then_the_gemv(norm_dtype):
    x = torch.randn(1, H).bfloat16()
    nw = _norm_weight(norm_dtype, 1)
    wqkv = random_weight("Q4_1", Q + 2 * 64, H, seed=1)
    got = ext.decode_layer_head(x, nw, 1e-5, [wqkv.data], [wqkv.qtype])
    want = _gemv(cpu_fused.rms_norm(x, nw, 1e-5), wqkv)
    assert torch.equal(got, want)


def test_head_of_row_parts_is_gemv_parts():
    """A QuantRows qkv (Q4_K_M: q, k and v of different types): gemv_parts' product."""
    x = torch.randn(1, H).bfloat16()
    nw = _norm_weight(torch.float32, 2)
    parts = [
        random_weight(t, n, H, seed=i) for i, (t, n) in enumerate([("Q5_0", Q), ("Q8_0", 128)])
    ]
    got = ext.decode_layer_head(x, nw, 1e-6, [p.data for p in parts], [p.qtype for p in parts])
    h = cpu_fused.rms_norm(x, nw, 1e-6)
    want = ext.gemv_parts(h, [p.data for p in parts], [p.qtype for p in parts], None)
    assert torch.equal(got, want)


def _tail_weights(types):
    wo = random_weight(types[0], H, Q, seed=2)
    wgu = random_weight(types[1], 2 * N, H, seed=3)
    wd = random_weight(types[0], H, N, seed=4)
    wqkv = random_weight(types[1], Q + 128, H, seed=5)
    return wo, wgu, wd, wqkv


@pytest.mark.parametrize(("act", "types"), [(1, ("Q4_1", "Q8_0")), (2, ("Q4_K", "Q6_K"))])
@pytest.mark.parametrize("with_next", [True, False])
def test_tail_is_the_per_layer_sequence(act, types, with_next):
    a, x = torch.randn(1, Q).bfloat16(), torch.randn(1, H).bfloat16()
    wo, wgu, wd, wqkv = _tail_weights(types)
    post, nxt = _norm_weight(torch.bfloat16, 6), _norm_weight(torch.float32, 7)
    x2, qkv = ext.decode_layer_tail(
        a, x, wo.data, wo.qtype, post, 1e-6, wgu.data, wgu.qtype, act, wd.data, wd.qtype,
        nxt if with_next else None, 1e-5, [wqkv.data] if with_next else [], [wqkv.qtype],
    )  # fmt: skip
    x1 = _gemv(a, wo, residual=x)
    want = _gemv(_gemv(cpu_fused.rms_norm(x1, post, 1e-6), wgu, act=act), wd, residual=x1)
    assert torch.equal(x2, want)
    if with_next:
        assert torch.equal(qkv, _gemv(cpu_fused.rms_norm(want, nxt, 1e-5), wqkv))
    else:
        assert qkv is None


def test_sandwich_tail_is_the_per_layer_sequence():
    """Gemma's layer: each block's output normed before its add (fused.rms_norm_add)."""
    a, x = torch.randn(1, Q).bfloat16(), torch.randn(1, H).bfloat16()
    wo, wgu, wd, wqkv = _tail_weights(("Q4_K", "Q5_0"))
    post_attn, pre_ffw, post_ffw, nxt = (_norm_weight(torch.float32, s) for s in (8, 9, 10, 11))
    x2, qkv = ext.decode_sandwich_tail(
        a, x, wo.data, wo.qtype, post_attn, pre_ffw, 1e-6, wgu.data, wgu.qtype, 2, wd.data,
        wd.qtype, post_ffw, nxt, 1e-6, [wqkv.data], [wqkv.qtype],
    )  # fmt: skip
    x1 = cpu_fused.rms_norm_add(_gemv(a, wo), post_attn, x, 1e-6)
    g = _gemv(cpu_fused.rms_norm(x1, pre_ffw, 1e-6), wgu, act=2)
    want = cpu_fused.rms_norm_add(_gemv(g, wd), post_ffw, x1, 1e-6)
    assert torch.equal(x2, want)
    assert torch.equal(qkv, _gemv(cpu_fused.rms_norm(want, nxt, 1e-6), wqkv))


def test_tail_refuses_what_it_cannot_run():
    a, x = torch.randn(2, Q).bfloat16(), torch.randn(2, H).bfloat16()
    w = random_weight("Q8_0", H, Q)
    n = _norm_weight(torch.bfloat16, 0)
    with pytest.raises(RuntimeError, match="one contiguous bf16 row"):
        ext.decode_layer_tail(a, x, w.data, w.qtype, n, 1e-6, w.data, w.qtype, 1, w.data, w.qtype,
                              None, 0.0, [], [])  # fmt: skip
    with pytest.raises(RuntimeError, match="act 1"):
        ext.decode_layer_tail(a[:1], x[:1], w.data, w.qtype, n, 1e-6, w.data, w.qtype, 0,
                              w.data, w.qtype, None, 0.0, [], [])  # fmt: skip


# <bos> <start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n
GEMMA_IDS = [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105, 4368, 107]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_model_decode_steps_equal_the_per_layer_path(which, request, monkeypatch):
    """The default SmolLM2 Q4_1 (pre-norm layers) and Gemma 3 270M Q4_K_M (sandwich
    layers, q/k/v of mixed types) kept quantized: prefill, then decode steps through the
    chain and through the per-layer path on two caches: every step's hidden states equal
    bit for bit, and the chain is what ran (and not for the prefill, nor when off)."""
    from pagewarden.kernels.attention import AttentionMetadata
    from pagewarden.models.loader import load_causal_lm, load_model

    if which == "gemma3":
        model = load_causal_lm(request.getfixturevalue("gemma3_gguf"), torch.bfloat16, "gguf").model
        prompt = GEMMA_IDS
    else:
        model = load_model(None, torch.bfloat16, "gguf").model
        prompt = [1, 504, 3458, 314, 4649, 30]
    cfg, bs = model.config, 16
    runs = {}
    for mode in ("chain", "per-layer"):
        monkeypatch.setenv(decode_chain.ENV, "1" if mode == "chain" else "0")
        model.use_compute_dtype(torch.bfloat16)  # the chain is built again at first use
        caches = [
            torch.zeros(2, 4, bs, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16)
            for _ in range(cfg.num_hidden_layers)
        ]
        calls: list[int] = []

        def counted(self, *args, calls=calls, run=DecodeChain.run):
            calls.append(1)
            return run(self, *args)

        monkeypatch.setattr(DecodeChain, "run", counted)
        table, ctx, new, hidden = [2, 0, 3], 0, list(prompt), []
        for _ in range(6):
            sl = [table[p // bs] * bs + p % bs for p in range(ctx, ctx + len(new))]
            meta = AttentionMetadata.build([len(new)], [ctx], [table], sl, bs, "cpu")
            h = model(torch.tensor(new), torch.arange(ctx, ctx + len(new)), caches, meta)
            hidden.append(h)
            ctx += len(new)
            new = [int(model.compute_logits(h[-1:]).argmax(-1))]
        runs[mode] = hidden
        assert len(calls) == (5 if mode == "chain" else 0)  # the decode steps, not the prefill
        assert (model._decode_chain is not None) == (mode == "chain")
        monkeypatch.undo()
    for got, want in zip(runs["chain"], runs["per-layer"]):
        assert torch.equal(got, want)


def test_build_refuses_models_it_cannot_chain():
    """A dense (unquantized) model: no chain; its forward takes the per-layer path."""
    from pagewarden.models.llama import LlamaConfig, LlamaForCausalLM

    c = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
        max_position_embeddings=64, rope_theta=10000.0,
    )  # fmt: skip
    assert DecodeChain.build(LlamaForCausalLM(c).model.layers) is None
