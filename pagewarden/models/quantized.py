"""Quantized GGUF weights into a model: the load-time half of ``kernels/cpu/quant``.

A model's ``load_weights`` hands over the HF-named ``QuantWeight`` tensors the loader kept
quantized; ``attach_quantized`` concatenates the shards of fused layers row-wise (each row
of a GGUF tensor is independent blocks, so [q; k; v] and [gate; up] are their rows one
after the other, as for dense weights) and attaches each weight to its module
(``kernels/cpu/linear.attach``), which drops the module's dense parameter. A tied lm_head
shares the embedding's blocks; it returns float32 logits (``QuantWeight.float_out``).
"""

from __future__ import annotations

from torch import nn

from pagewarden.kernels.cpu import linear as cpu_linear
from pagewarden.kernels.cpu.quant import QuantWeight


def attach_quantized(
    model: nn.Module,
    shards: dict[str, list[tuple[int, QuantWeight]]],
    tied: dict[str, str] | None = None,
) -> None:
    """``shards``: parameter name (fused name for fused layers) -> [(shard index, weight)];
    ``tied``: module name -> the module whose weight it shares (the lm_head -> the
    embedding). Raises KeyError on a shard set that does not match the parameter."""
    params = dict(model.named_parameters(remove_duplicate=False))
    attached: dict[str, QuantWeight] = {}
    for name, parts in shards.items():
        parts = sorted(parts, key=lambda p: p[0])
        weight = parts[0][1] if len(parts) == 1 else QuantWeight.cat([w for _, w in parts])
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
        cpu_linear.attach(
            model.get_submodule("lm_head"),
            QuantWeight(head.data, head.qtype, head.shape, float_out=True),
        )
