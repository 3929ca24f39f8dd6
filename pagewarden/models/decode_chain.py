"""A one-token decode step of pre-norm layers with quantized weights, in two calls a layer.

At one stream a decode step is ~120 one-row GEMVs of a few tens of microseconds each, and
each layer was seven calls from Python into C++ (two norms, four GEMVs, the attention),
each with its Python frames, argument parsing and output tensor. After the forward pass's
weights have streamed through the caches, that Python runs cold: it was about a third of
the main thread's time in a SmolLM2 Q4_1 step (``perf``; docs/quantization.md). Here a
layer is the attention call (unchanged: RoPE, the K/V write with its tags and the
attention's integrity checks, ``Attention.attend_qkv``) and one ``decode_layer_tail`` of
the quantized extension, which runs o_proj with the residual, the post-attention norm, the
gated MLP with the residual, and the next layer's input norm and qkv GEMV in C++::

    qkv = decode_layer_head(x, norm_0, qkv_0)
    for each layer i:
        a = attention_i.attend_qkv(qkv, cos, sin, cache_i, meta)
        x, qkv = decode_layer_tail(a, x, o_i, post_norm_i, gate_up_i, down_i,
                                   norm_{i+1}, qkv_{i+1})      # qkv None after the last

Every operation is the same kernel on the same bytes as the per-layer path (the norm is
the fused extension's own row function, reached through ``norm_api.h``), so the hidden
states are equal bit for bit (``tests/models/test_decode_chain.py``). It applies where
every layer is a plain ``DecoderLayer`` whose four projections are single-type GGUF
weights without bias and the step is one bf16 row of decode (``DecoderForCausalLM``
checks the step); elsewhere the per-layer path runs. ``PAGEWARDEN_DECODE_CHAIN=0`` turns
it off (for A/B measurements; read when a model's chain is built, at its first forward).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from pagewarden.kernels.attention import AttentionMetadata
from pagewarden.kernels.cpu import quant as cpu_quant
from pagewarden.kernels.cpu.linear import quant_weight
from pagewarden.models.layers import Attention, DecoderLayer, RMSNorm

#: Set to 0 to run every decode step through the per-layer path.
ENV = "PAGEWARDEN_DECODE_CHAIN"

_ACTS = {"silu": 1, "gelu_tanh": 2}


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() != "0"


def applies(x: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether a step with hidden rows x runs through the chain: one bf16 row of decode,
    and the one-row rule of ``quant.gemm`` is the int8 GEMV (not forced to bf16)."""
    return (
        x.shape[0] == 1
        and x.dtype is torch.bfloat16
        and meta.is_decode
        and cpu_quant.FORCED_KERNEL in (None, "int8")
        and cpu_quant.INT8_MAX_ROWS >= 1
    )


@dataclass(frozen=True)
class _Layer:
    attn: Attention
    head: tuple  # decode_layer_head's (norm weight, eps, qkv data, qkv type)
    tail: tuple  # decode_layer_tail's (o, o type, post norm, eps, gate_up, type, act, down, type)


class DecodeChain:
    """The chained decode step of one model (``build``), run by ``run``."""

    def __init__(self, ext: ModuleType, layers: list[_Layer]) -> None:
        self._ext = ext
        self._layers = layers
        # each layer's tail with the next layer's head (None, 0, None, 0 after the last)
        self._tails = [
            (*layer.tail, *(layers[i + 1].head if i + 1 < len(layers) else (None, 0.0, None, 0)))
            for i, layer in enumerate(layers)
        ]

    @staticmethod
    def build(layers: nn.ModuleList) -> DecodeChain | None:
        """The chain of ``layers``, or None where some layer is not one it can run."""
        ext = cpu_quant.load() if enabled() else None
        if ext is None or not ext.has_decode_chain():
            return None
        chained = []
        for layer in layers:
            if type(layer) is not DecoderLayer:
                return None
            norm, attn, o_proj, post_norm, mlp, down_proj = layer._blocks
            act = _ACTS.get(mlp.activation)
            projections = [attn.qkv_proj, o_proj, mlp.gate_up_proj, down_proj]
            weights = [_plain_quant(p) for p in projections]
            norms = [_norm_weight(n) for n in (norm, post_norm)]
            if act is None or None in weights or None in norms:
                return None
            qkv, o, gate_up, down = weights
            head = (norms[0], norm.eps, qkv.data, qkv.qtype)
            tail = (o.data, o.qtype, norms[1], post_norm.eps, gate_up.data, gate_up.qtype, act,
                    down.data, down.qtype)  # fmt: skip
            chained.append(_Layer(attn, head, tail))
        return DecodeChain(ext, chained) if chained else None

    def run(
        self,
        x: torch.Tensor,
        rotations: list[tuple[torch.Tensor, torch.Tensor]],
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The layers' output (1, hidden) for one bf16 decode row x (1, hidden)."""
        ext = self._ext
        qkv = ext.decode_layer_head(x, *self._layers[0].head)
        for layer, tail, cache in zip(self._layers, self._tails, kv_caches):
            cos, sin = rotations[layer.attn.rope_index]
            a = layer.attn.attend_qkv(qkv, cos, sin, cache, meta)
            x, qkv = ext.decode_layer_tail(a, x, *tail)
        return x


def _plain_quant(layer: nn.Linear) -> cpu_quant.QuantWeight | None:
    """The layer's quantized weight where the chain's GEMVs take it: one GGUF type, no
    bias, a bf16 output."""
    q = quant_weight(layer)
    if not isinstance(q, cpu_quant.QuantWeight) or layer.bias is not None or q.float_out:
        return None
    return q


def _norm_weight(norm: RMSNorm) -> torch.Tensor | None:
    """What the norm multiplies by, where the chain's norm takes it (bf16 or float32)."""
    w = norm.factor()
    if w.dim() != 1 or not w.is_contiguous() or w.dtype not in (torch.bfloat16, torch.float32):
        return None
    return w
