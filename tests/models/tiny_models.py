"""Tiny random float32 checkpoints of every supported architecture, made by transformers
(HF directories, sharded on request) and written as GGUFs the way llama.cpp names and
stores their tensors (Q/K permuted for ``llama``, Gemma's norms as 1 + w, Phi-3's fused
``attn_qkv`` / ``ffn_up``, Llama 3's ``rope_freqs``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from conftest import make_tiny_tokenizer

WINDOW = 8  # sliding window of the tiny models: the test prompts are longer
_BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.08,  # sharper than 0.02: fewer near-ties between logits
)
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small: the scaling changes short contexts
}


def _configs() -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (transformers config class, its arguments)."""
    half = _BASE["head_dim"] // 2
    phi3 = dict(
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": 128,
        },
        original_max_position_embeddings=128,
        sliding_window=None,
        pad_token_id=0,
    )
    return {
        "llama": ("LlamaConfig", dict(rope_parameters={"rope_theta": 10000.0, **_LLAMA3})),
        "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
        "qwen2": (
            "Qwen2Config",
            dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        ),
        "qwen3": ("Qwen3Config", dict()),
        "gemma2": (
            "Gemma2Config",
            dict(
                sliding_window=WINDOW,
                query_pre_attn_scalar=24,
                attn_logit_softcapping=3.0,
                final_logit_softcapping=5.0,
            ),
        ),
        "gemma3": (
            "Gemma3TextConfig",
            dict(
                sliding_window=WINDOW,
                query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                },
            ),
        ),
        "phi3": ("Phi3Config", phi3),
        "phi3_window": ("Phi3Config", {**phi3, "sliding_window": WINDOW}),
    }


ARCHS = tuple(_configs())


def make_tiny(name: str, path: Path, max_shard_size: str | None = None, **overrides) -> Path:
    """Save a seeded random transformers model of architecture ``name`` (+ the tiny
    tokenizer) to ``path``; sharded into several safetensors with ``max_shard_size``."""
    import transformers

    cls_name, kw = _configs()[name]
    path.mkdir(parents=True, exist_ok=True)
    vocab = make_tiny_tokenizer(path)
    args = {**_BASE, "vocab_size": max(vocab, 512), **kw, **overrides}
    config = getattr(transformers, cls_name)(**args)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    save = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **save)
    return path


def hf_state(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert permutation of Q/K rows (rotate-half -> interleaved)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_LAYER = {  # HF module path -> llama.cpp tensor kind
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
_PRE_NORM = {"post_attention_layernorm": "ffn_norm"}
_GEMMA = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_gguf(hf_dir: Path, out: Path) -> Path:
    """The tiny HF checkpoint in ``hf_dir`` as an F32 GGUF, as convert_hf_to_gguf writes it."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = {"mistral": "llama", "gemma3_text": "gemma3"}.get(
        cfg["model_type"], cfg["model_type"]
    )
    gemma = model_type.startswith("gemma")
    w = gguf.GGUFWriter(str(out), model_type)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    if gemma and model_type == "gemma3":
        full, local = rope["full_attention"], rope["sliding_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_float32(f"{model_type}.rope.freq_base_swa", local["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    else:
        w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if cfg.get("sliding_window") and model_type in ("llama", "phi3", "gemma2", "gemma3"):
        w.add_sliding_window(cfg["sliding_window"])
    if gemma:
        pattern = [t == "sliding_attention" for t in cfg["layer_types"]]
        w.add_sliding_window_pattern(pattern)
    if cfg.get("attn_logit_softcapping"):
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    _add_tokenizer(w, hf_dir, cfg["vocab_size"])

    state = hf_state(hf_dir)
    layer_names = {**_LAYER, **(_GEMMA if gemma else _PRE_NORM)}
    for name, arr in state.items():
        arr = arr.astype(np.float32)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.get("tie_word_embeddings"):
                continue
            gguf_name = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.<module path>.<weight|bias>
            module = ".".join(parts[3:-1])
            kind = layer_names[module]
            if model_type == "llama" and kind == "attn_q":
                arr = _permute(arr, heads)
            elif model_type == "llama" and kind == "attn_k":
                arr = _permute(arr, kv)
            gguf_name = f"blk.{parts[2]}.{kind}.{parts[-1]}"
        if gemma and gguf_name.endswith("norm.weight"):
            arr = arr + 1  # llama.cpp stores Gemma's norms as 1 + w
        w.add_tensor(gguf_name, np.ascontiguousarray(arr))
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_factors(rope, cfg["head_dim"]))
    if rope.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_uint32(
            f"{model_type}.rope.scaling.original_context_length",
            rope["original_max_position_embeddings"],
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _llama3_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs for llama3 scaling: theta_i's divisors."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_tokenizer(w, hf_dir: Path, vocab_size: int) -> None:
    """The tiny byte-level BPE tokenizer as GGUF ``gpt2`` metadata, padded to the model's vocab."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = [""] * vocab_size
    types = [1] * vocab_size
    for t, i in vocab.items():
        tokens[i] = t
    for added in tok.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3
    for i in range(vocab_size):
        if not tokens[i]:
            tokens[i], types[i] = f"[PAD{i}]", 5
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")  # the tiny tokenizer splits with ByteLevel's GPT-2 regex
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
