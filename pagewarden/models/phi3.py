"""Phi-3 (mini/medium, 4k and 128k): the pre-norm decoder of ``layers.py`` with q/k/v and
gate/up stored fused (``qkv_proj``, ``gate_up_proj``), a sliding window on every layer
where the config sets one, and ``longrope`` (``su``) RoPE scaling.

longrope has a short and a long factor set. transformers rotates a whole sequence with
the short set while it is at most ``original_max_position_embeddings`` (O) long and with
the long set once it is longer, and recomputes every position when a sequence grows past
O. pagewarden does the same per request: the RoPE table holds both sets
(``RopeTable``), the scheduler marks each request short or long from its length and
restarts it from position 0 when it grows past O (``SchedulerConfig.rope_switch_tokens``),
and KV rotated with the long set is hashed apart in the prefix cache. The default context
is O (``max_model_len`` unset: only the short set is ever used); a longer one, up to
``max_position_embeddings``, serves short and long requests alike.

llama.cpp stores ``attn_qkv`` and ``ffn_up`` (= [gate; up]) fused too, unpermuted, and the
longrope factors as the tensors ``rope_factors_short`` / ``rope_factors_long``.
"""

from __future__ import annotations

from typing import Any

from pagewarden.models.architecture import GGUF_TENSORS, Architecture, GGUFMeta
from pagewarden.models.causal_lm import DecoderForCausalLM
from pagewarden.models.config import ModelConfig, freeze, hf_common, rope_type


def _cap_context(config: dict[str, Any]) -> dict[str, Any]:
    """The default context of a longrope model is its original one (short factors, exact
    for every prompt); the extended one is kept in the scaling for ``select_context``."""
    scaling = dict(config["rope_scaling"] or ())
    if rope_type(config["rope_scaling"]) == "longrope":
        old = int(scaling["original_max_position_embeddings"])
        scaling.setdefault("max_position_embeddings", config["max_position_embeddings"])
        config["rope_scaling"] = freeze(scaling)
        config["max_position_embeddings"] = min(config["max_position_embeddings"], old)
    return config


def phi3_from_hf(d: dict[str, Any]) -> ModelConfig:
    common = hf_common(d)
    scaling = dict(common["rope_scaling"] or ())
    if rope_type(common["rope_scaling"]) == "longrope":
        scaling.setdefault(
            "original_max_position_embeddings",
            d.get("original_max_position_embeddings", common["max_position_embeddings"]),
        )
        if scaling.get("factor") is None:  # transformers: max / original
            scaling["factor"] = (
                common["max_position_embeddings"] / scaling["original_max_position_embeddings"]
            )
        scaling["rope_type"] = "longrope"
        scaling.pop("type", None)
        common["rope_scaling"] = freeze(scaling)
    window = d.get("sliding_window")
    common.update(sliding_window=int(window) if window else None, layer_types=None)
    return ModelConfig(**_cap_context(common))


def phi3_from_gguf(meta: GGUFMeta) -> ModelConfig:
    common = meta.common()
    names = meta.tensor_names
    if "rope_factors_short.weight" in names:
        old = int(
            meta.get("rope.scaling.original_context_length", common["max_position_embeddings"])
        )
        scaling = {
            "rope_type": "longrope",
            "short_factor": [float(x) for x in meta.array("rope_factors_short.weight").reshape(-1)],
            "long_factor": [float(x) for x in meta.array("rope_factors_long.weight").reshape(-1)],
            "original_max_position_embeddings": old,
            "attention_factor": meta.get("rope.scaling.attn_factor"),
            "factor": common["max_position_embeddings"] / old,
        }
        common["rope_scaling"] = freeze(scaling)
    window = meta.get("attention.sliding_window")
    common.update(sliding_window=int(window) if window else None)
    return ModelConfig(**_cap_context(common))


PHI3 = Architecture(
    name="phi3",
    hf_names=("Phi3ForCausalLM",),
    gguf_name="phi3",
    model_cls=DecoderForCausalLM,
    config_from_hf=phi3_from_hf,
    config_from_gguf=phi3_from_gguf,
    gguf_tensors={**GGUF_TENSORS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    gguf_config_tensors=("rope_factors_short.weight", "rope_factors_long.weight"),
)
