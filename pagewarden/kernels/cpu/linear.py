"""Linear layers on the CPU through weights packed once for the GEMM library.

A plain ``F.linear`` hands the weight to oneDNN or MKL in its (out, in) layout, and the
library reorders it into its blocked layout again on every call. Packing once at load
time and calling the library with the packed copy removes that cost, which is most of a
decode step's GEMM time at small batches. Three packings, chosen by ``pick_packing``:

    tiles    our own bf16 GEMM (``cpu_gemm``; AVX512-BF16 without AMX, where oneDNN
             keeps its AMX kernels): bf16 layers without a bias, o_proj and down_proj
             with the residual add fused, gate_up_proj with act(gate) * up fused
             (``linear_gated``, act SiLU or GELU-tanh); faster than oneDNN from 1 to
             2048 rows on the machine measured (a 2-core Zen 4). Layers it cannot take (a bias, an odd
             K) get the oneDNN packing.
    onednn   ``torch.ops.mkldnn._linear_pointwise`` over ``_reorder_linear_weight``: every
             layer, any number of rows; the residual add of o_proj and down_proj is fused
             into the GEMM (``linear_add``). Used for bf16/fp16, and for float32 where the
             CPU has AVX-512 (measured faster than MKL there at every batch size).
    mkl      MKL's pre-packed sgemm (``_mkl_linear``), float32 on CPUs without AVX-512:
             only one-row calls of the wide layers (lm_head, gate_up_proj) gain from it
             there, so only they are packed and only one-row calls take it.

The packed copy lives beside the layer's ``weight`` (``layer.__dict__``, not a parameter)
and is rebuilt by ``pack`` whenever the weights change dtype; ``unpack`` drops it. Bench:
``bench/linear_prepack.py``.

A layer may instead carry a GGUF block-quantized weight (``attach``; ``kernels/cpu/quant``):
then its ``weight`` parameter is empty, every call below goes through the quantized GEMM
(epilogues fused the same way), ``pack`` leaves it alone, and ``embedding`` decodes the
gathered rows of a quantized embedding table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from pagewarden.kernels.cpu import fused as cpu_fused
from pagewarden.kernels.cpu import gemm as cpu_gemm
from pagewarden.kernels.cpu import hugepages
from pagewarden.kernels.cpu import quant as cpu_quant

Packing = Literal["tiles", "onednn", "mkl"]
Put = Callable[[torch.Tensor], None]  # stores a moved tensor where its holder keeps it

_TILES = "gemm_tiles"  # cpu_gemm tiles, plain column order
_GATE_UP = "gemm_tiles_gate_up"  # cpu_gemm tiles, gate and up interleaved (silu fused)
_ONEDNN = "onednn_weight"
_MKL = "mkl_single_row"
_QUANT = "quant_weight"  # a cpu_quant.QuantWeight (or QuantRows) replacing the weight


def pick_packing(dtype: torch.dtype, device: torch.device) -> Packing | None:
    """The packing for layers computing in ``dtype`` on ``device``; None: plain F.linear."""
    if device.type != "cpu":
        return None
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if dtype == torch.bfloat16 and cpu_gemm.available() and not _has_amx():
        return "tiles"
    if dtype in (torch.bfloat16, torch.float16):
        return "onednn" if onednn else None
    if dtype != torch.float32:
        return None
    if onednn and torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return "onednn"
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        return "mkl"
    return None


def _has_amx() -> bool:
    """AMX tiles: oneDNN's bf16 GEMMs run on them there (our kernel has no AMX path and
    was not measured against them), so such CPUs keep the oneDNN packing."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def pack(
    layer: nn.Linear, packing: Packing | None, wide: bool = False, gate_up: bool = False
) -> None:
    """Give ``layer`` a packed copy of its weight for ``packing`` (``wide``: a layer
    worth packing for one-row calls under ``mkl``; ``gate_up``: a [gate; up] layer called
    through ``linear_gated``); None removes any packed copy."""
    unpack(layer)
    if _QUANT in layer.__dict__:
        return  # computes from its quantized weight
    weight = layer.weight.detach()
    if packing == "tiles":
        if layer.bias is None and cpu_gemm.fits(weight, gate_up):
            key = _GATE_UP if gate_up else _TILES
            layer.__dict__[key] = cpu_gemm.pack_tiles(weight, gate_up)
            return
        packing = "onednn"  # a layer the kernel does not take
    if packing == "onednn":
        layer.__dict__[_ONEDNN] = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    elif packing == "mkl" and wide:
        layer.__dict__[_MKL] = torch.ops.mkl._mkl_reorder_linear_weight(weight, 1)


def to_hugepages(model: nn.Module) -> int:
    """Move what the CPU kernels stream into huge pages (``kernels/cpu/hugepages``): the
    layers' quantized blocks and packed tiles, and parameters of at least
    ``hugepages.MIN_BYTES``. A tensor shared by several modules (a tied lm_head) stays
    one tensor. Returns the bytes moved; 0 where ``hugepages.enabled()`` is false."""
    if not hugepages.enabled():
        return 0
    # one entry per tensor: the tensor, and where each holder stores its moved copy
    moves: dict[tuple[int, torch.dtype, tuple[int, ...]], tuple[torch.Tensor, list[Put]]] = {}

    def want(t: torch.Tensor | None, put: Put) -> None:
        if t is None or t.device.type != "cpu" or not t.is_contiguous():
            return
        if t.numel() * t.element_size() >= hugepages.MIN_BYTES:
            moves.setdefault((t.data_ptr(), t.dtype, tuple(t.shape)), (t, []))[1].append(put)

    for module in model.modules():
        d = module.__dict__
        for key in (_TILES, _GATE_UP):
            want(d.get(key), lambda new, d=d, key=key: d.__setitem__(key, new))
        q = d.get(_QUANT)  # a QuantWeight, or a QuantRows of several
        for w in () if q is None else getattr(q, "parts", (q,)):
            want(w.data, lambda new, w=w: setattr(w, "data", new))
        for p in module.parameters(recurse=False):
            want(p.data, lambda new, p=p: setattr(p, "data", new))
    if not moves:
        return 0
    groups = list(moves.values())
    with torch.no_grad():
        copies = hugepages.relocate([t for t, _ in groups])
    for (_, puts), new in zip(groups, copies):
        for put in puts:
            put(new)
    moved = sum(t.numel() * t.element_size() for t in copies)
    moves.clear()  # the old tensors: freed now, before the heap is trimmed
    groups.clear()
    hugepages.release_freed_heap()
    return moved


def unpack(layer: nn.Linear) -> None:
    """Drop the layer's packed copy: it computes with ``F.linear`` again."""
    for key in (_TILES, _GATE_UP, _ONEDNN, _MKL):  # not _QUANT: that is the weight
        layer.__dict__.pop(key, None)


def attach(layer: nn.Module, weight: cpu_quant.QuantWeight | cpu_quant.QuantRows) -> None:
    """Make ``layer`` (an nn.Linear, or an nn.Embedding read through ``embedding``) compute
    from ``weight``; its ``weight`` parameter is replaced by an empty one (same dtype), so
    no dense copy is kept. A parameter tied to another module's stays tied only by name:
    give that module the same QuantWeight."""
    unpack(layer)
    layer.__dict__[_QUANT] = weight
    old = layer.weight
    layer.weight = nn.Parameter(old.new_empty(0), requires_grad=False)


def quant_weight(layer: nn.Module) -> cpu_quant.QuantWeight | cpu_quant.QuantRows | None:
    """The layer's quantized weight, if it has one."""
    return layer.__dict__.get(_QUANT)


def embedding(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """``module(ids)``, decoding only the gathered rows where the table is quantized."""
    q = module.__dict__.get(_QUANT)
    if q is None:
        return module(ids)
    assert isinstance(q, cpu_quant.QuantWeight), "an embedding table is one GGUF tensor"
    return cpu_quant.embedding(q, ids, module.weight.dtype).view(*ids.shape, q.shape[1])


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for x (T, in) -> (T, out), through the packed weight when there is one."""
    q = layer.__dict__.get(_QUANT)
    if q is not None:
        out = cpu_quant.gemm(x, q)
        return out if layer.bias is None else out + layer.bias
    tiles = layer.__dict__.get(_TILES)
    if tiles is not None:
        out = cpu_gemm.gemm(x, tiles, layer.out_features)
        if out is not None:
            return out
    packed = layer.__dict__.get(_ONEDNN)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
    packed = layer.__dict__.get(_MKL)
    if packed is not None and x.shape[0] == 1:
        return torch.ops.mkl._mkl_linear(x.contiguous(), packed, layer.weight, layer.bias, 1)
    return F.linear(x, layer.weight, layer.bias)


def linear_add(layer: nn.Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + layer(x)``, the add fused into the GEMM where the library can."""
    q = layer.__dict__.get(_QUANT)
    if q is not None:
        if layer.bias is not None:
            return residual + linear(layer, x)
        return cpu_quant.gemm(x, q, residual=residual)
    tiles = layer.__dict__.get(_TILES)
    if tiles is not None:
        out = cpu_gemm.gemm(x, tiles, layer.out_features, residual)
        if out is not None:
            return out
        return residual + linear(layer, x)
    packed = layer.__dict__.get(_ONEDNN)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, layer.bias, "add")
    if layer.bias is not None:
        return residual + layer(x)
    return torch.addmm(residual, x, layer.weight.t())


def linear_gated(layer: nn.Linear, x: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up (T, I) of ``layer`` = [gate; up] (2I, in) applied to x (T, in),
    ``act`` "silu" or "gelu_tanh" (torch's approximate="tanh"): one fused call where the
    layer was packed with ``gate_up=True``; else the GEMM, then the activation (SiLU*mul
    fused, GELU-tanh in torch: two ops, each rounded; a quantized layer fuses GELU-tanh
    wherever ``quant.gemv_gated`` has a kernel for the rows: all but 2-4 prefill rows)."""
    q = layer.__dict__.get(_QUANT)
    if isinstance(q, cpu_quant.QuantWeight) and layer.bias is None:
        if act == "silu":
            return cpu_quant.gemm(x, q, silu_mul=True)
        out = cpu_quant.gemv_gated(x, q, act) if act == "gelu_tanh" else None
        if out is not None:  # GELU-tanh fused into the int8 kernels or the bf16 tiles
            return out
    tiles = layer.__dict__.get(_GATE_UP)
    if tiles is not None:
        out = cpu_gemm.gemm(x, tiles, layer.out_features, act=act)
        if out is not None:
            return out
    if act == "silu":
        return cpu_fused.silu_mul(linear(layer, x))
    if act != "gelu_tanh":
        raise ValueError(f"gated activation {act!r}: silu or gelu_tanh")
    gate, up = linear(layer, x).split(layer.out_features // 2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)
