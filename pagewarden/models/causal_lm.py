"""The decoder every family shares: embeddings, a stack of layers, the final norm and the
LM head, over a paged KV cache. A family picks its layer class and its config; weights
arrive HF-named (``load_weights``), with separate q/k/v and gate/up fused on the way in.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagewarden.kernels.attention import AttentionMetadata, AttentionOps
from pagewarden.kernels.backend import AttentionBackendError
from pagewarden.kernels.cpu import fused as cpu_fused
from pagewarden.kernels.cpu import linear as cpu_linear
from pagewarden.kernels.cpu.linear import embedding, linear
from pagewarden.kernels.cpu.quant import QuantWeight
from pagewarden.models import decode_chain
from pagewarden.models.config import ModelConfig
from pagewarden.models.decode_chain import DecodeChain
from pagewarden.models.layers import (
    Attention,
    DecoderLayer,
    GatedMLP,
    RMSNorm,
    RopeTable,
    compute_dtype_for,
)
from pagewarden.models.quantized import attach_quantized, densify_mixed


class DecoderModel(nn.Module):
    def __init__(self, c: ModelConfig, layer_cls: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(layer_cls(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)


_FUSED = {  # HF name part -> (fused name part, shard index)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _missing_parts(param: str, loaded: set[str]) -> list[str]:
    """HF names that should have filled ``param`` but were not loaded."""
    for fused, parts in (
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("gate_up_proj", ("gate_proj", "up_proj")),
    ):
        if f".{fused}." in param:
            if param in loaded:  # a checkpoint that stores it fused (Phi-3)
                return []
            return [param.replace(fused, p) for p in parts if param.replace(fused, p) not in loaded]
    return [] if param in loaded else [param]


class DecoderForCausalLM(nn.Module):
    """A decoder-only LM whose attention reads and writes a paged KV cache.

    ``layer_cls`` is the family's decoder layer (``layers.DecoderLayer``: pre-norm).
    """

    layer_cls: type[nn.Module] = DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.layer_cls)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Table 0 rotates every layer, table 1 (when present) the sliding layers.
        self.ropes = [RopeTable(config.head_dim, config.rope_theta, config.rope_scaling)]
        if config.local_rope_theta is not None:
            self.ropes.append(RopeTable(config.head_dim, config.local_rope_theta, None))
        # The dtype the weights were loaded in; the KV cache uses it too.
        self.storage_dtype: torch.dtype | None = None
        self._attention = self.attention_layers()
        # One-token decode steps of quantized layers in two calls a layer (decode_chain.py);
        # False: to be built at the first forward, None: not for this model.
        self._decode_chain: DecodeChain | None | bool = False

    def attention_features(self) -> list[str]:
        """The ``attend`` keywords some layer of this model needs (sliding_window, softcap)."""
        needs = set()
        for attn in self.attention_layers():
            if attn.sliding_window is not None:
                needs.add("sliding_window")
            if attn.softcap is not None:
                needs.add("softcap")
        return sorted(needs)

    def attention_layers(self) -> list[Attention]:
        """Each layer's attention, in layer order."""
        return [m for m in self.modules() if isinstance(m, Attention)]

    def set_attention_ops(self, ops: AttentionOps) -> None:
        """Write and read the KV cache through ``ops`` in every layer.

        Raises ``AttentionBackendError`` (and changes nothing) when the model needs a
        feature that ``ops.attend`` does not take: it would compute something else.
        """
        params = inspect.signature(ops.attend).parameters
        missing = [f for f in self.attention_features() if f not in params]
        if missing:
            raise AttentionBackendError(
                f"{type(ops).__name__} does not implement {' and '.join(missing)}, which "
                "this model needs; use --attention-backend torch"
            )
        for attn in self.attention_layers():
            attn.ops = ops

    def use_compute_dtype(self, dtype: torch.dtype | None = None) -> torch.dtype:
        """Compute in `dtype` (None: `compute_dtype_for` this machine); returns it.

        Converts every parameter; their values stay those of `storage_dtype`.
        """
        assert self.storage_dtype is not None, "load weights first"
        device = self.model.norm.weight.device
        dtype = dtype or compute_dtype_for(self.storage_dtype, device)
        with torch.no_grad():
            for p in self.parameters():  # a tied lm_head is the embedding's Parameter
                p.data = p.data.to(dtype)
            # Weights packed once for the GEMM library (see kernels/cpu/linear.py).
            packing = cpu_linear.pick_packing(dtype, device)
            gate_up = {id(m.gate_up_proj) for m in self.modules() if isinstance(m, GatedMLP)}
            wide = {id(self.lm_head)} | gate_up
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    cpu_linear.pack(
                        module, packing, wide=id(module) in wide, gate_up=id(module) in gate_up
                    )
                elif isinstance(module, RMSNorm):
                    module.prepare()
        if device.type == "cpu":
            cpu_linear.to_hugepages(self)  # the streamed weights in 2 MiB pages
            cpu_fused.load()  # built now (once per machine), not in the first request
        for rope in self.ropes:
            rope.reset()
        self._decode_chain = False  # built again from the weights as they are now
        return dtype

    def select_context(self, max_model_len: int) -> int | None:
        """Fit the RoPE tables to contexts of up to ``max_model_len`` tokens; return the
        sequence length past which a request is rotated with longrope's long factors
        (None: one factor set for every request), as transformers picks them."""
        switches = {rope.select_context(max_model_len) for rope in self.ropes} - {None}
        assert len(switches) <= 1, "one longrope switch per model"
        return switches.pop() if switches else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T, hidden) input embeddings; times sqrt(hidden) in their own dtype (Gemma)."""
        x = embedding(self.model.embed_tokens, input_ids)  # rows decoded if quantized
        if self.config.embed_scale:
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        rope_long: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states (T, hidden) of the new tokens; writes their K/V into kv_caches.
        ``rope_long`` (T,) bool: the tokens rotated with longrope's long factors (the
        requests longer than ``select_context``'s switch)."""
        assert input_ids.dim() == 1 and input_ids.shape == positions.shape
        assert len(kv_caches) == self.config.num_hidden_layers
        x = self.embed(input_ids)  # (T, hidden)
        size, device = self.config.max_position_embeddings, x.device
        rotations = [
            rope.lookup(positions, size, x.dtype, device, rope_long if i == 0 else None)
            for i, rope in enumerate(self.ropes)
        ]
        chain = self._decode_chain
        if chain is False:  # not built yet (after the weights are in their final place)
            chain = self._decode_chain = DecodeChain.build(self.model.layers)
        if chain is not None and decode_chain.applies(x, meta):
            return self.model.norm(chain.run(x, rotations, kv_caches, meta))
        for layer, attn, cache in zip(self.model.layers, self._attention, kv_caches):
            cos, sin = rotations[attn.rope_index]  # (T, 1, D)
            x = layer.forward(x, cos, sin, cache, meta)  # no hooks: see models/layers.py
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32
    ) -> torch.Tensor:
        """Logits (S, vocab) for hidden states (S, hidden), in ``dtype`` (None: the GEMM's
        own dtype, which the sampler widens only where it needs to); soft-capped where the
        model caps them."""
        logits = linear(self.lm_head, hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits if dtype is None else logits.to(dtype)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up; raises KeyError on unknown or
        missing names. A ``QuantWeight`` (a GGUF tensor kept quantized) is attached to its
        module instead (``models/quantized.py``), fused shards concatenated row-wise.
        Then picks the compute dtype for this machine (`use_compute_dtype`).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        if self.storage_dtype is None:
            self.storage_dtype = self.model.norm.weight.dtype
        loaded: set[str] = set()
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [c.intermediate_size] * 2}
        quantized: dict[str, list[tuple[int, QuantWeight]]] = {}  # kept quantized (GGUF)
        dense: set[str] = set()  # targets written densely (a mixed fused layer's test)
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
            dense.add(target)
            with torch.no_grad():
                tensor = tensor.to(self.storage_dtype)  # rounded even when p is wider
                if shard is None:
                    p.copy_(tensor)
                else:
                    sz = sizes[shard[0]]
                    p.narrow(0, sum(sz[: shard[1]]), sz[shard[1]]).copy_(tensor)
            loaded.add(name)
        tied = {"lm_head": "model.embed_tokens"} if c.tie_word_embeddings else {}
        densify_mixed(params, quantized, dense, sizes)
        attach_quantized(self, quantized, tied)
        for n in params:
            if c.tie_word_embeddings and n == "lm_head.weight":
                continue
            missing = _missing_parts(n, loaded)
            if missing:
                raise KeyError(f"missing weights {missing}")
        self.use_compute_dtype()
