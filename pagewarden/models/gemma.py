"""Gemma 2 and Gemma 3 (text): (1 + w) RMSNorms, a norm before and after both attention
and MLP, a GELU-tanh gated MLP, embeddings scaled by sqrt(hidden_size), sliding-window
layers alternating with global ones, scores scaled by ``query_pre_attn_scalar``; Gemma 2
soft-caps attention scores and final logits, Gemma 3 normalises q and k per head and
gives its sliding layers their own RoPE base (``rope_local_base_freq``).

llama.cpp stores Gemma's norm weights as 1 + w (the loader subtracts ``norm_offset``)
and does not permute Q/K for Gemma.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagewarden.kernels.cpu.linear import linear
from pagewarden.models.architecture import GGUF_TENSORS, Architecture, GGUFMeta
from pagewarden.models.causal_lm import DecoderForCausalLM
from pagewarden.models.config import (
    FULL,
    SLIDING,
    ModelConfig,
    UnsupportedModelError,
    freeze,
    hf_common,
    hf_rope,
    refuse,
)
from pagewarden.models.layers import Attention, GatedMLP, RMSNorm
from pagewarden.models.llama import gguf_rope


class SandwichDecoderLayer(nn.Module):
    """x + post_norm(attn(pre_norm(x))), then x + post_norm(mlp(pre_norm(x)))."""

    decode_chain_kind = "sandwich"  # what models/decode_chain.py runs it as (this class only)

    def __init__(self, c: ModelConfig, layer: int) -> None:
        super().__init__()
        eps, off = c.rms_norm_eps, c.norm_offset
        self.input_layernorm = RMSNorm(c.hidden_size, eps, off)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps, off)
        self.pre_feedforward_layernorm = RMSNorm(c.hidden_size, eps, off)
        self.mlp = GatedMLP(c)
        self.post_feedforward_layernorm = RMSNorm(c.hidden_size, eps, off)
        self._blocks = (  # plain references (models/layers.py's docstring)
            self.input_layernorm, self.self_attn, self.self_attn.o_proj,
            self.post_attention_layernorm, self.pre_feedforward_layernorm, self.mlp,
            self.post_feedforward_layernorm,
        )  # fmt: skip

    def forward(self, x, cos, sin, cache, meta) -> torch.Tensor:
        pre_attn, attn, o_proj, post_attn, pre_mlp, mlp, post_mlp = self._blocks
        a = attn.forward(pre_attn.forward(x), cos, sin, cache, meta)  # (T, q_size)
        x = post_attn.add_to(x, linear(o_proj, a))
        return post_mlp.add_to(x, mlp.forward(pre_mlp.forward(x)))  # (T, hidden)


class GemmaForCausalLM(DecoderForCausalLM):
    layer_cls = SandwichDecoderLayer


def _alternating(n: int, pattern: int) -> tuple[str, ...]:
    """Every ``pattern``-th layer global, the others sliding (Gemma's default)."""
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))


def _gemma_common(d: dict[str, Any], pattern: int) -> dict[str, Any]:
    refuse(d, d.get("model_type", "gemma"), use_bidirectional_attention=False)
    d = {"hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, **d}
    if d.get("hidden_act") and d.get("hidden_activation"):
        d.pop("hidden_act")  # transformers' Gemma reads hidden_activation
    common = hf_common(d)
    if common["layer_types"] is None:
        pattern = d.get("sliding_window_pattern", pattern)
        common["layer_types"] = _alternating(d["num_hidden_layers"], pattern)
    window = d.get("sliding_window")
    if window is None:
        common["layer_types"] = None
    return dict(
        **common,
        sliding_window=int(window) if window else None,
        norm_offset=1.0,
        embed_scale=True,
        query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
        attn_logit_softcapping=d.get("attn_logit_softcapping"),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        attention_bias=bool(d.get("attention_bias", False)),
        o_proj_bias=bool(d.get("attention_bias", False)),
    )


def gemma2_from_hf(d: dict[str, Any]) -> ModelConfig:
    d = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, **d}
    return ModelConfig(**_gemma_common(d, pattern=2))


def gemma3_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Gemma 3's text config: global RoPE (with its scaling) on full layers, an unscaled
    local base on sliding ones (``rope_parameters`` per layer type, or the older
    ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``)."""
    if "text_config" in d:
        raise UnsupportedModelError("Gemma 3 multimodal checkpoints: load the text model only")
    common = _gemma_common(d, pattern=6)
    if isinstance((d.get("rope_parameters") or {}).get(FULL), dict):
        theta, scaling = hf_rope(d, FULL)
        local, local_scaling = hf_rope(d, SLIDING)
        if local_scaling is not None:
            raise UnsupportedModelError("RoPE scaling on Gemma 3's sliding layers")
        common.update(rope_theta=theta, rope_scaling=freeze(scaling))
    else:
        local = float(d.get("rope_local_base_freq", 10000.0))
        if "rope_theta" not in d and not d.get("rope_parameters"):
            common["rope_theta"] = 1_000_000.0
    return ModelConfig(**common, qk_norm=True, local_rope_theta=local)


def _gguf_layer_types(meta: GGUFMeta, n: int, default: int) -> tuple[str, ...]:
    """llama.cpp's ``attention.sliding_window_pattern``: an int (every n-th layer global)
    or one bool per layer (True: sliding); absent: the family's default."""
    pattern = meta.get("attention.sliding_window_pattern", default)
    if isinstance(pattern, list):
        return tuple(SLIDING if p else FULL for p in pattern)
    return _alternating(n, int(pattern))


def _gemma_from_gguf(meta: GGUFMeta, pattern: int, layers_27b: int) -> dict[str, Any]:
    common = {**meta.common(), **gguf_rope(meta)}
    window = meta.get("attention.sliding_window")
    n = common["num_hidden_layers"]
    # GGUF has no query_pre_attn_scalar: llama.cpp uses head_dim, hidden / heads for 27B.
    scalar = common["head_dim"]
    if n == layers_27b:
        scalar = common["hidden_size"] // common["num_attention_heads"]
    return dict(
        **common,
        hidden_act="gelu_tanh",
        sliding_window=int(window) if window else None,
        layer_types=_gguf_layer_types(meta, n, pattern) if window else None,
        norm_offset=1.0,
        embed_scale=True,
        query_pre_attn_scalar=float(scalar),
    )


def gemma2_from_gguf(meta: GGUFMeta) -> ModelConfig:
    caps = {
        "attn_logit_softcapping": meta.get("attn_logit_softcapping"),
        "final_logit_softcapping": meta.get("final_logit_softcapping"),
    }
    return ModelConfig(**_gemma_from_gguf(meta, 2, layers_27b=46), **caps)


def gemma3_from_gguf(meta: GGUFMeta) -> ModelConfig:
    local = float(meta.get("rope.freq_base_swa", 10000.0))  # llama.cpp's default for gemma3
    if "rope_freqs.weight" in meta.tensor_names:
        raise UnsupportedModelError("rope_freqs on a gemma3 GGUF")
    return ModelConfig(
        **_gemma_from_gguf(meta, 6, layers_27b=62), qk_norm=True, local_rope_theta=local
    )


_GEMMA_TENSORS = {
    **GGUF_TENSORS,
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

GEMMA2 = Architecture(
    name="gemma2",
    hf_names=("Gemma2ForCausalLM",),
    gguf_name="gemma2",
    model_cls=GemmaForCausalLM,
    config_from_hf=gemma2_from_hf,
    config_from_gguf=gemma2_from_gguf,
    gguf_tensors=_GEMMA_TENSORS,
)
GEMMA3 = Architecture(
    name="gemma3",
    hf_names=("Gemma3ForCausalLM",),
    gguf_name="gemma3",
    model_cls=GemmaForCausalLM,
    config_from_hf=gemma3_from_hf,
    config_from_gguf=gemma3_from_gguf,
    gguf_tensors=_GEMMA_TENSORS,
)
