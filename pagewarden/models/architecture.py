"""What a family module declares about itself, for the registry and the loaders.

An ``Architecture`` names the checkpoints it reads (HF ``architectures[0]`` values, the
GGUF ``general.architecture``), the model class, how its config is read from each
format, and how llama.cpp named and stored its tensors in a GGUF.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagewarden.models.causal_lm import DecoderForCausalLM
from pagewarden.models.config import ModelConfig

#: llama.cpp's per-layer tensor kinds (``blk.N.<kind>.weight``) -> HF module path, for
#: the pre-norm families; a family overrides or adds kinds (``Architecture.gguf_tensors``).
GGUF_TENSORS: Mapping[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
#: Global GGUF tensors -> HF names (the rest, such as rope_freqs, feed the config).
GGUF_GLOBALS: Mapping[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GGUFMeta:
    """A GGUF's metadata, read once: ``get`` looks keys up under the architecture's prefix;
    ``array`` dequantizes a tensor (for tensors that hold config, such as rope_freqs)."""

    arch: str
    fields: Mapping[str, Any]
    tensor_names: frozenset[str]
    array: Callable[[str], np.ndarray]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.arch}.{key}", default)

    def common(self) -> dict[str, Any]:
        """The ``ModelConfig`` fields every family reads the same way (llama.cpp's keys)."""
        heads = int(self.get("attention.head_count"))
        hidden = int(self.get("embedding_length"))
        eps = self.get("attention.layer_norm_rms_epsilon", 1e-6)
        return dict(
            vocab_size=len(self.fields["tokenizer.ggml.tokens"]),
            hidden_size=hidden,
            intermediate_size=int(self.get("feed_forward_length")),
            num_hidden_layers=int(self.get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self.get("attention.head_count_kv", heads)),
            head_dim=int(self.get("attention.key_length", hidden // heads)),
            rms_norm_eps=float(eps),
            rope_theta=float(self.get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(self.get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in self.tensor_names,
            attention_bias="blk.0.attn_q.bias" in self.tensor_names,
            o_proj_bias="blk.0.attn_output.bias" in self.tensor_names,
            bos_token_id=self.fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.fields.get("tokenizer.ggml.eos_token_id"),
        )


@dataclass(frozen=True)
class Architecture:
    """One family's entry in the registry (``registry.ARCHITECTURES``)."""

    name: str
    hf_names: tuple[str, ...]
    gguf_name: str | None
    model_cls: type[DecoderForCausalLM]
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    config_from_gguf: Callable[[GGUFMeta], ModelConfig] | None = None
    gguf_tensors: Mapping[str, str] = field(default_factory=lambda: dict(GGUF_TENSORS))
    #: llama.cpp permuted Q/K rows for its interleaved RoPE (the ``llama`` arch only).
    gguf_permuted_qk: bool = False
    #: GGUF tensors that feed the config, not a parameter (rope_freqs, ...).
    gguf_config_tensors: tuple[str, ...] = ("rope_freqs.weight",)
