"""Llama (Llama 2/3.x incl. ``llama3`` RoPE scaling, SmolLM2) and Mistral (sliding window):
the pre-norm decoder of ``layers.py`` as it is; Mistral is Llama with its window."""

from __future__ import annotations

from typing import Any

from pagewarden.models.architecture import Architecture, GGUFMeta
from pagewarden.models.causal_lm import DecoderForCausalLM
from pagewarden.models.config import ModelConfig, UnsupportedModelError, freeze, hf_common

# The classes under their historical names (the Llama family uses the shared decoder).
LlamaConfig = ModelConfig
LlamaForCausalLM = DecoderForCausalLM


def llama_from_hf(d: dict[str, Any]) -> ModelConfig:
    bias = bool(d.get("attention_bias", False))
    return ModelConfig(**hf_common(d), attention_bias=bias, o_proj_bias=bias)


def mistral_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Llama's config plus ``sliding_window`` on every layer (None: full attention)."""
    window = d.get("sliding_window")
    # transformers' Mistral ignores layer_types (it windows every layer): so do we.
    common = {**hf_common(d), "layer_types": None}
    return ModelConfig(**common, sliding_window=int(window) if window else None)


def gguf_rope(meta: GGUFMeta) -> dict[str, Any]:
    """``rope_scaling`` of a GGUF: its ``rope.scaling.*`` keys, or the ``rope_freqs``
    tensor convert_hf_to_gguf writes for Llama 3.1+ (llama3 scaling as per-frequency
    divisors)."""
    kind = meta.get("rope.scaling.type", "none")
    if "rope_freqs.weight" in meta.tensor_names:
        if kind not in ("none", "llama3"):
            raise UnsupportedModelError(f"rope_freqs together with rope scaling {kind!r}")
        factors = tuple(float(x) for x in meta.array("rope_freqs.weight").reshape(-1))
        return {"rope_scaling": freeze({"rope_type": "freq_factors", "factors": factors})}
    if kind == "none":
        return {}
    if kind == "linear":
        factor = float(meta.get("rope.scaling.factor", 1.0))
        return {"rope_scaling": freeze({"rope_type": "linear", "factor": factor})}
    raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported")


def llama_from_gguf(meta: GGUFMeta) -> ModelConfig:
    window = meta.get("attention.sliding_window")
    return ModelConfig(
        **meta.common(), **gguf_rope(meta), sliding_window=int(window) if window else None
    )


LLAMA = Architecture(
    name="llama",
    hf_names=("LlamaForCausalLM",),
    gguf_name="llama",
    model_cls=DecoderForCausalLM,
    config_from_hf=llama_from_hf,
    config_from_gguf=llama_from_gguf,
    gguf_permuted_qk=True,
)
MISTRAL = Architecture(
    name="mistral",
    hf_names=("MistralForCausalLM",),
    gguf_name=None,  # llama.cpp writes Mistral as "llama"
    model_cls=DecoderForCausalLM,
    config_from_hf=mistral_from_hf,
)
