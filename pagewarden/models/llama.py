"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2) over a paged KV cache."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagewarden.kernels.attention import AttentionMetadata, AttentionOps, TorchAttention
from pagewarden.kernels.cpu import fused as cpu_fused
from pagewarden.kernels.cpu import linear as cpu_linear
from pagewarden.kernels.cpu.linear import embedding, linear, linear_add, linear_silu_mul
from pagewarden.kernels.cpu.quant import QuantWeight
from pagewarden.models.quantized import attach_quantized


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family model, validated on construction."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")

    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> LlamaConfig:
        """Read an HF config.json dict (both `rope_parameters` and `rope_theta` spellings)."""
        rope = d.get("rope_parameters") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        if (
            scaling is not None
            and scaling.get("rope_type", scaling.get("type", "default")) == "default"
        ):
            scaling = None
        heads = d["num_attention_heads"]
        return LlamaConfig(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", d.get("model_type") == "qwen2")),
            o_proj_bias=bool(d.get("attention_bias", False)) and d.get("model_type") != "qwen2",
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,), with Llama 3 scaling when configured."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = dict(config.rope_scaling or ())
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old / low) & (wavelen >= old / high)
        inv = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind is not None:
        raise ValueError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")
    return inv.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm in float32, rounded once to x's dtype (one C++ pass on the CPU)."""
        return cpu_fused.rms_norm(x, self.weight, self.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (T, H, D); cos, sin_signed (T, 1, D) from `LlamaForCausalLM._rope`.

    rotate_half(x) = [-x2, x1] is x with its halves swapped (one flip of a (2, D/2)
    view) times [-1, +1], and that sign is folded into `sin_signed` = [-sin, +sin].
    Where the fused CPU op runs, x itself is rotated in place and returned; otherwise x
    is left as it was and a new tensor returned (see `cpu_fused.rope`): use the result.
    """
    return cpu_fused.rope(x, cos, sin_signed)


def compute_dtype_for(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a model loaded in `dtype` computes in on `device`.

    CPUs without native bf16/fp16 GEMM kernels (oneDNN's check: no AVX512 core, AMX or
    equivalent) run bf16 GEMMs through a reference path 10-20x slower than float32. There
    the model computes in float32, as llama.cpp does with BF16 weights on such CPUs: the
    weights keep exactly their `dtype`-rounded values and the KV cache stays in `dtype`.
    """
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return dtype
    if dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return dtype
    return torch.float32


class LlamaAttention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(
            c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=c.o_proj_bias)
        self.scale = self.head_dim**-0.5
        self.ops: AttentionOps = TorchAttention()  # the worker may pick another backend

    def forward(self, x, cos, sin, cache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention output (T, n_heads * D), before o_proj (the layer adds the residual)."""
        t, d = x.shape[0], self.head_dim
        qkv = linear(self.qkv_proj, x)  # (T, q_size + 2 * kv_size)
        # q and k are adjacent columns: one RoPE call rotates both.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.n_heads + self.n_kv, d)
        q, k = apply_rope(qk, cos, sin).split([self.n_heads, self.n_kv], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.n_kv, d)  # (T, n_kv, D)
        self.ops.write_kv(cache, k, v, meta)
        out = self.ops.attend(q, cache, meta, self.scale, new_kv=(k, v))  # (T, n_heads, D)
        return out.reshape(t, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.intermediate_size = c.intermediate_size

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up (T, intermediate), before down_proj (fused into the GEMM where
        kernels/cpu/linear can, else from its (T, 2 * intermediate) output)."""
        return linear_silu_mul(self.gate_up_proj, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.down_proj, self.act(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = LlamaAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = LlamaMLP(c)

    def forward(self, x, cos, sin, cache, meta) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)  # (T, q_size)
        x = linear_add(self.self_attn.o_proj, attn, x)  # (T, hidden)
        return linear_add(self.mlp.down_proj, self.mlp.act(self.post_attention_layernorm(x)), x)


class LlamaModel(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


_FUSED = {  # HF name part -> (fused name part, shard index)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Llama decoder whose attention reads and writes a paged KV cache."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # The dtype the weights were loaded in; the KV cache uses it too.
        self.storage_dtype: torch.dtype | None = None

    def set_attention_ops(self, ops: AttentionOps) -> None:
        """Write and read the KV cache through ``ops`` in every layer."""
        for layer in self.model.layers:
            layer.self_attn.ops = ops

    def use_compute_dtype(self, dtype: torch.dtype | None = None) -> torch.dtype:
        """Compute in `dtype` (None: `compute_dtype_for` this machine); returns it.

        Converts every parameter; their values stay those of `storage_dtype`.
        """
        assert self.storage_dtype is not None, "load weights first"
        dtype = dtype or compute_dtype_for(self.storage_dtype, self.model.norm.weight.device)
        with torch.no_grad():
            for p in self.parameters():  # a tied lm_head is the embedding's Parameter
                p.data = p.data.to(dtype)
            # Weights packed once for the GEMM library (see cpu_linear.py).
            packing = cpu_linear.pick_packing(dtype, self.model.norm.weight.device)
            gate_up = {id(layer.mlp.gate_up_proj) for layer in self.model.layers}
            wide = {id(self.lm_head)} | gate_up
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    cpu_linear.pack(
                        module, packing, wide=id(module) in wide, gate_up=id(module) in gate_up
                    )
        if self.model.norm.weight.device.type == "cpu":
            cpu_fused.load()  # built now (once per machine), not in the first request
        self._rope_cache = None
        return dtype

    def _rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed (T, 1, head_dim) for `positions` (see `apply_rope`), from a
        table built once; one lookup per step serves every layer."""
        need = int(positions.max()) + 1
        if (
            self._rope_cache is None
            or self._rope_cache[0].shape[0] < need
            or self._rope_cache[0].dtype != dtype
        ):
            n = max(need, self.config.max_position_embeddings)
            freqs = torch.outer(
                torch.arange(n, dtype=torch.float32), rope_inv_freq(self.config)
            )  # (n, D/2)
            cos, sin = freqs.cos(), freqs.sin()
            dev = self.model.embed_tokens.weight.device
            self._rope_cache = (
                torch.cat((cos, cos), dim=-1).to(dev, dtype),  # (n, D)
                torch.cat((-sin, sin), dim=-1).to(dev, dtype),  # (n, D)
            )
        cos, sin = self._rope_cache
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states (T, hidden) of the new tokens; writes their K/V into kv_caches."""
        assert input_ids.dim() == 1 and input_ids.shape == positions.shape
        assert len(kv_caches) == self.config.num_hidden_layers
        x = embedding(self.model.embed_tokens, input_ids)  # (T, hidden)
        cos, sin = self._rope(positions, x.dtype)  # (T, 1, D)
        for layer, cache in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, cache, meta)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32
    ) -> torch.Tensor:
        """Logits (S, vocab) for hidden states (S, hidden), in ``dtype`` (None: the GEMM's
        own dtype, which the sampler widens only where it needs to)."""
        logits = linear(self.lm_head, hidden)
        return logits if dtype is None else logits.to(dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up; raises KeyError on unknown or missing names.

        Then picks the compute dtype for this machine (`use_compute_dtype`).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        if self.storage_dtype is None:
            self.storage_dtype = self.model.norm.weight.dtype
        loaded: set[str] = set()
        c = self.config
        sizes = {
            "qkv_proj": [
                c.num_attention_heads * c.head_dim,
                c.num_key_value_heads * c.head_dim,
                c.num_key_value_heads * c.head_dim,
            ],
            "gate_up_proj": [c.intermediate_size, c.intermediate_size],
        }
        quantized: dict[str, list[tuple[int, QuantWeight]]] = {}  # kept quantized (GGUF)
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            target, shard = name, None
            for part, (fused, idx) in _FUSED.items():
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), (fused, idx)
                    break
            if target not in params:
                raise KeyError(f"unexpected weight {name!r}")
            if isinstance(tensor, QuantWeight):
                quantized.setdefault(target, []).append((shard[1] if shard else 0, tensor))
                loaded.add(name)
                continue
            p = params[target]
            with torch.no_grad():
                tensor = tensor.to(self.storage_dtype)  # rounded even when p is wider
                if shard is None:
                    p.copy_(tensor)
                else:
                    sz = sizes[shard[0]]
                    start = sum(sz[: shard[1]])
                    p.narrow(0, start, sz[shard[1]]).copy_(tensor)
            loaded.add(name)
        tied = {"lm_head": "model.embed_tokens"} if c.tie_word_embeddings else {}
        attach_quantized(self, quantized, tied)
        expected = 0
        for n in params:
            if c.tie_word_embeddings and n == "lm_head.weight":
                continue
            for fused, parts in (
                ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                ("gate_up_proj", ("gate_proj", "up_proj")),
            ):
                if f".{fused}." in n:
                    missing = [
                        n.replace(fused, p) for p in parts if n.replace(fused, p) not in loaded
                    ]
                    break
            else:
                missing = [] if n in loaded else [n]
            if missing:
                raise KeyError(f"missing weights {missing}")
            expected += 1
        self.use_compute_dtype()
