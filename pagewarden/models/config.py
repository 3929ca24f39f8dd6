"""What a decoder-only model is made of: one validated config for every family.

Each family module (``llama.py``, ``qwen.py``, ``gemma.py``, ``phi3.py``) turns its
checkpoint's config (HF ``config.json`` or GGUF metadata) into a ``ModelConfig``; the
shared blocks of ``layers.py`` read only this. A checkpoint that asks for something these
blocks do not compute raises ``UnsupportedModelError`` naming it, at load time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"

#: RoPE scalings ``layers.rope_inv_freq`` computes ("freq_factors": GGUF ``rope_freqs``).
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "freq_factors")
#: MLP activations of ``layers.GatedMLP`` (HF ``hidden_act`` / ``hidden_activation`` names).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class UnsupportedModelError(ValueError):
    """The checkpoint needs a feature pagewarden does not implement; the message names it."""


Scaling = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and features of a decoder, validated on construction.

    Invariants: ``layer_types`` (when set) has one entry per layer, each ``SLIDING`` or
    ``FULL``, and a sliding layer implies ``sliding_window``; ``rope_scaling`` is one of
    ``ROPE_TYPES``. Defaults are Llama's.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Scaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = field(default=None, hash=False)
    # Family features; each default is "off".
    hidden_act: str = "silu"  # "silu" | "gelu_tanh": act(gate) * up
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma's 1
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    sliding_window: int | None = None  # a sliding layer's query at p sees p - W < j <= p
    layer_types: tuple[str, ...] | None = None  # None: every layer FULL
    local_rope_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma 3)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2, not head_dim's
    attn_logit_softcapping: float | None = None  # cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # cap * tanh(logits / cap)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the model's dtype

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise UnsupportedModelError(f"MLP activation {self.hidden_act!r} is not supported")
        kind = rope_type(self.rope_scaling)
        if kind not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES[:-1])})"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError("layer_types needs one entry per layer")
            unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
            if unknown:
                raise UnsupportedModelError(f"layer types {unknown} are not supported")
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need a sliding_window")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``; None: it attends to its whole context."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None


def rope_type(scaling: Scaling | dict[str, Any] | None) -> str:
    """The RoPE type of a scaling (HF spells it ``rope_type`` or ``type``; ``su``: longrope)."""
    d = dict(scaling or ())
    kind = str(d.get("rope_type", d.get("type", "default")))
    return "longrope" if kind == "su" else kind


def freeze(d: dict[str, Any] | None) -> Scaling | None:
    """A scaling dict as sorted items with lists as tuples (hashable); None for default."""
    if not d or rope_type(d) == "default":
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


def hf_rope(d: dict[str, Any], key: str | None = None) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) of an HF config: ``rope_parameters`` (transformers 5, or its
    ``key`` entry for per-layer-type parameters) or ``rope_theta`` + ``rope_scaling``."""
    params = d.get("rope_parameters") or {}
    if key is not None:
        params = params.get(key) or {}
    theta = params.get("rope_theta", d.get("rope_theta"))
    scaling = d.get("rope_scaling") if key is None else None
    scaling = scaling or (params if rope_type(params) != "default" else None)
    return float(theta if theta is not None else 10000.0), scaling


def refuse(d: dict[str, Any], what: str, **unsupported: Any) -> None:
    """Raise ``UnsupportedModelError`` if config ``d`` sets any key of ``unsupported`` to
    anything but its value there (the only value we compute)."""
    for key, ok in unsupported.items():
        value = d.get(key)
        if value is not None and value != ok:
            raise UnsupportedModelError(f"{what}: {key}={value!r} is not supported (only {ok!r})")


def hf_common(d: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelConfig`` fields every family reads the same way from an HF config."""
    heads = d["num_attention_heads"]
    theta, scaling = hf_rope(d)
    rope_params = d.get("rope_parameters") or {}
    if d.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 (partial RoPE) is not supported")
    act = d.get("hidden_act") or d.get("hidden_activation") or "silu"
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"MLP activation {act!r} is not supported")
    if d.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    layer_types = d.get("layer_types")
    return dict(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=freeze(scaling),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        hidden_act=ACTIVATIONS[act],
        layer_types=tuple(layer_types) if layer_types else None,
    )
