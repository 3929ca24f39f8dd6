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

A sandwich layer (Gemma 2 / 3: each block's output normed before its residual add) has
its own tail, ``decode_sandwich_tail``, the same way. Every operation is the same kernel
on the same bytes as the per-layer path (the norms are the fused extension's own row
functions, reached through ``norm_api.h``; a ``QuantRows`` qkv goes through
``gemv_parts``' loop), so the hidden states are equal bit for bit
(``tests/models/test_decode_chain.py``). It applies where every layer is a plain
``DecoderLayer`` or ``SandwichDecoderLayer`` whose projections are GGUF weights without
bias (qkv may be several types in row parts, the others one type each), and the step is
one bf16 row of decode (``DecoderForCausalLM`` checks the step); elsewhere the per-layer
path runs. ``PAGEWARDEN_DECODE_CHAIN=0`` turns
it off (for A/B measurements; read when a model's chain is built, at its first forward).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from pagewarden.kernels.attention import AttentionMetadata
from pagewarden.kernels.cpu import quant as cpu_quant
from pagewarden.kernels.cpu.linear import quant_weight
from pagewarden.models.layers import Attention, RMSNorm

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
    head: tuple  # decode_layer_head's (norm weight, eps, [qkv parts' data], [their types])
    tail: Callable  # the extension's decode_layer_tail or decode_sandwich_tail
    args: tuple  # its arguments after (a, x) and before the next layer's head


class DecodeChain:
    """The chained decode step of one model (``build``), run by ``run``."""

    def __init__(self, ext: ModuleType, layers: list[_Layer]) -> None:
        self._ext = ext
        self._layers = layers
        # each layer's tail arguments with the next layer's head (none after the last)
        last = (None, 0.0, [], [])
        self._tails = [
            (layer.tail, (*layer.args, *(layers[i + 1].head if i + 1 < len(layers) else last)))
            for i, layer in enumerate(layers)
        ]

    @staticmethod
    def build(layers: nn.ModuleList) -> DecodeChain | None:
        """The chain of ``layers``, or None where some layer is not one it can run."""
        ext = cpu_quant.load() if enabled() else None
        if ext is None or not ext.has_decode_chain():
            return None
        chained = [_chain_layer(ext, layer) for layer in layers]
        if not chained or None in chained:
            return None
        return DecodeChain(ext, chained)  # type: ignore[arg-type]

    def run(
        self,
        x: torch.Tensor,
        rotations: list[tuple[torch.Tensor, torch.Tensor]],
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The layers' output (1, hidden) for one bf16 decode row x (1, hidden)."""
        qkv = self._ext.decode_layer_head(x, *self._layers[0].head)
        for layer, (tail, args), cache in zip(self._layers, self._tails, kv_caches):
            cos, sin = rotations[layer.attn.rope_index]
            a = layer.attn.attend_qkv(qkv, cos, sin, cache, meta)
            x, qkv = tail(a, x, *args)
        return x


def _chain_layer(ext: ModuleType, layer: nn.Module) -> _Layer | None:
    """One layer's part of the chain: a pre-norm ``DecoderLayer`` or a sandwich layer
    (Gemma's), every norm with one eps; None where the chain cannot run it."""
    # The layer class's own ``decode_chain_kind`` (not an inherited one: a subclass may
    # compute something else); gemma.py's sandwich layer says "sandwich".
    kind = type(layer).__dict__.get("decode_chain_kind")
    if kind == "pre_norm":
        norm, attn, o_proj, post_norm, mlp, down_proj = layer._blocks
        norms = [norm, post_norm]
    elif kind == "sandwich":
        norm, attn, o_proj, post_attn, pre_mlp, mlp, post_mlp = layer._blocks
        norms = [norm, post_attn, pre_mlp, post_mlp]
        down_proj = mlp.down_proj
    else:
        return None
    act = _ACTS.get(mlp.activation)
    qkv = _qkv_parts(attn.qkv_proj)
    o, gate_up, down = (_plain_quant(p) for p in (o_proj, mlp.gate_up_proj, down_proj))
    factors = [_norm_weight(n) for n in norms]
    if act is None or qkv is None or None in (o, gate_up, down) or None in factors:
        return None
    if len({n.eps for n in norms}) != 1:
        return None
    assert o is not None and gate_up is not None and down is not None
    head = (factors[0], norm.eps, *qkv)
    if len(norms) == 2:
        args = (o.data, o.qtype, factors[1], norm.eps, gate_up.data, gate_up.qtype, act,
                down.data, down.qtype)  # fmt: skip
        return _Layer(attn, head, ext.decode_layer_tail, args)
    args = (o.data, o.qtype, factors[1], factors[2], norm.eps, gate_up.data, gate_up.qtype, act,
            down.data, down.qtype, factors[3])  # fmt: skip
    return _Layer(attn, head, ext.decode_sandwich_tail, args)


def _qkv_parts(layer: nn.Linear) -> tuple[list[torch.Tensor], list[int]] | None:
    """The qkv projection's quantized row parts (one for a single-type weight, several
    for a ``QuantRows``: Q4_K_M's q, k and v of different types), without bias."""
    q = quant_weight(layer)
    if layer.bias is not None:
        return None
    if isinstance(q, cpu_quant.QuantRows):
        parts = list(q.parts)
    elif isinstance(q, cpu_quant.QuantWeight):
        parts = [q]
    else:
        return None
    if any(p.float_out for p in parts):
        return None
    return [p.data for p in parts], [p.qtype for p in parts]


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
