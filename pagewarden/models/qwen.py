"""Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (q/k RMSNorm per head, before RoPE): the
pre-norm decoder of ``layers.py``. Both may window their upper layers
(``use_sliding_window``: layers from ``max_window_layers`` on, or ``layer_types``)."""

from __future__ import annotations

from typing import Any

from pagewarden.models.architecture import Architecture, GGUFMeta
from pagewarden.models.causal_lm import DecoderForCausalLM
from pagewarden.models.config import FULL, SLIDING, ModelConfig, hf_common
from pagewarden.models.llama import gguf_rope


def _hf_window(d: dict[str, Any]) -> dict[str, Any]:
    """sliding_window and layer_types as transformers derives them for Qwen2/3."""
    if not d.get("use_sliding_window") or not d.get("sliding_window"):
        return {"sliding_window": None, "layer_types": None}
    n, first = d["num_hidden_layers"], d.get("max_window_layers", d["num_hidden_layers"])
    types = d.get("layer_types") or [SLIDING if i >= first else FULL for i in range(n)]
    return {"sliding_window": int(d["sliding_window"]), "layer_types": tuple(types)}


def qwen2_from_hf(d: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**{**hf_common(d), **_hf_window(d)}, attention_bias=True)


def qwen3_from_hf(d: dict[str, Any]) -> ModelConfig:
    bias = bool(d.get("attention_bias", False))
    common = {**hf_common(d), **_hf_window(d)}
    return ModelConfig(**common, attention_bias=bias, o_proj_bias=bias, qk_norm=True)


def qwen_from_gguf(meta: GGUFMeta) -> ModelConfig:
    qk_norm = "blk.0.attn_q_norm.weight" in meta.tensor_names
    return ModelConfig(**meta.common(), **gguf_rope(meta), qk_norm=qk_norm)


QWEN2 = Architecture(
    name="qwen2",
    hf_names=("Qwen2ForCausalLM",),
    gguf_name="qwen2",
    model_cls=DecoderForCausalLM,
    config_from_hf=qwen2_from_hf,
    config_from_gguf=qwen_from_gguf,
)
QWEN3 = Architecture(
    name="qwen3",
    hf_names=("Qwen3ForCausalLM",),
    gguf_name="qwen3",
    model_cls=DecoderForCausalLM,
    config_from_hf=qwen3_from_hf,
    config_from_gguf=qwen_from_gguf,
)
