"""Quantized GGUF weights into a model: the load-time half of ``kernels/cpu/quant``.

A model's ``load_weights`` hands over the HF-named ``QuantWeight`` tensors the loader kept
quantized; ``attach_quantized`` concatenates the shards of fused layers row-wise (each row
of a GGUF tensor is independent blocks, so [q; k; v] and [gate; up] are their rows one
after the other, as for dense weights) and attaches each weight to its module
(``kernels/cpu/linear.attach``), which drops the module's dense parameter. A tied lm_head
shares the embedding's blocks; it returns float32 logits (``QuantWeight.float_out``).

A fused layer whose shards do not share one kernel type (Gemma 3 270M Q4_K_M: q/k Q5_0,
v Q8_0 in half the layers) stays quantized as a ``QuantRows`` (runs of one type, one GEMM
call each). One that got a dense shard too cannot be a quantized weight: ``densify_mixed``
decodes its quantized shards into the dense parameter instead.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagewarden.kernels.cpu import linear as cpu_linear
from pagewarden.kernels.cpu.quant import QuantRows, QuantWeight

log = logging.getLogger(__name__)

Shards = dict[str, list[tuple[int, QuantWeight]]]


def densify_mixed(
    params: dict[str, nn.Parameter],
    shards: Shards,
    dense: set[str],
    sizes: dict[str, list[int]],
) -> None:
    """Decode into ``params`` (and drop from ``shards``) the quantized shards of fused
    parameters that also got a dense shard (names in ``dense``); ``sizes``: fused name
    part (qkv_proj, ...) -> each shard's row count."""
    for name in list(shards):
        parts = shards[name]
        if name not in dense:
            continue
        rows = next((sz for fused, sz in sizes.items() if f".{fused}." in name), None)
        if rows is None or name not in params:
            raise KeyError(f"quantized weight {name!r} has no dense shard layout")
        p = params[name]
        with torch.no_grad():
            for idx, w in parts:
                p.narrow(0, sum(rows[:idx]), rows[idx]).copy_(w.dequantize().to(p.dtype))
        log.info("%s: quantized (%s) and dense shards, dequantized", name, _types(parts))
        del shards[name]


def _types(parts: list[tuple[int, QuantWeight]]) -> str:
    return ", ".join(sorted({w.type_name for _, w in parts}))


def attach_quantized(
    model: nn.Module,
    shards: Shards,
    tied: dict[str, str] | None = None,
) -> None:
    """``shards``: parameter name (fused name for fused layers) -> [(shard index, weight)];
    ``tied``: module name -> the module whose weight it shares (the lm_head -> the
    embedding). Raises KeyError on a shard set that does not match the parameter."""
    params = dict(model.named_parameters(remove_duplicate=False))
    attached: dict[str, QuantWeight | QuantRows] = {}
    for name, parts in shards.items():
        parts = sorted(parts, key=lambda p: p[0])
        weight = QuantRows.of([w for _, w in parts])  # a QuantWeight where one type
        if name not in params or tuple(params[name].shape) != weight.shape:
            want = tuple(params[name].shape) if name in params else None
            raise KeyError(f"quantized weight {name!r} {weight.shape} does not match {want}")
        module_name = name.rsplit(".", 1)[0]
        cpu_linear.attach(model.get_submodule(module_name), weight)
        attached[module_name] = weight
    for module_name, source in (tied or {}).items():
        if source in attached:
            cpu_linear.attach(model.get_submodule(module_name), attached[source])
            attached[module_name] = attached[source]
    if "lm_head" in attached:  # logits in float32, not rounded to bf16 (the same blocks)
        head = attached["lm_head"]
        assert isinstance(head, QuantWeight), "a tied lm_head is the embedding's one tensor"
        cpu_linear.attach(
            model.get_submodule("lm_head"),
            QuantWeight(head.data, head.qtype, head.shape, float_out=True),
        )
