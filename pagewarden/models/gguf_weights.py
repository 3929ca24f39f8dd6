"""GGUF tensors as the loader hands them to a model: dequantized to float32 (``none``,
the default), or kept in their block-quantized form as ``QuantWeight``s for the CPU
kernels (``gguf`` / ``auto``, experimental; see docs/quantization.md).

``gguf_weight`` turns one tensor into either form; ``keep_quantized`` says which the
loader asks for; ``release_map`` drops the file map's pages the build only copied from.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import warnings
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

#: ``--quantization`` values: none dequantizes at load (the default); gguf keeps the
#: tensors of types with a kernel quantized (an error where the kernel cannot build);
#: auto keeps them quantized where it builds, else dequantizes.
QUANTIZATION_MODES = ("none", "auto", "gguf")


class QuantizationError(RuntimeError):
    """``gguf`` was asked for where the quantized kernel cannot run, or a tensor's type
    has no decoder at all."""


def keep_quantized(quantization: str) -> bool:
    """Whether GGUF weights of types with a kernel stay quantized under ``quantization``."""
    from pagewarden.kernels.cpu import quant as cpu_quant

    if quantization not in QUANTIZATION_MODES:
        raise QuantizationError(
            f"quantization {quantization!r} is not one of {', '.join(QUANTIZATION_MODES)}"
        )
    if quantization == "none":
        return False
    ext = cpu_quant.load()
    if ext is None:
        if quantization == "gguf":
            raise QuantizationError(
                "quantization 'gguf': the quantized GEMM kernel cannot build here"
            )
        log.info(
            "quantization auto: GGUF weights dequantized (the quantized kernel is unavailable)"
        )
        return False
    if quantization == "auto" and not (ext.has_vector_kernel() and ext.has_int8_kernel()):
        log.info(
            "quantization auto: GGUF weights dequantized to bf16: this CPU lacks AVX512-BF16 "
            "or VNNI, where the quantized kernels are fast (--quantization gguf forces them)"
        )
        return False
    if quantization == "auto":
        log.info("quantization auto: GGUF weights kept quantized (--quantization none dequantizes)")
    return True


def gguf_weight(t: Any, quantize: bool, row_perm: np.ndarray | None = None) -> Any:
    """GGUF tensor ``t`` (a ``gguf.ReaderTensor``) as a ``QuantWeight`` (a 2-D weight of
    a type with a kernel, and ``quantize``: a view of the file's map unless ``row_perm``
    reorders its rows), else as a dequantized float32 array (logical shape, rows
    reordered by ``row_perm``). A 2-D weight of a type without a kernel is logged."""
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
        raise QuantizationError(f"tensor {t.name} has unsupported type {t.tensor_type.name}") from e
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    return arr if row_perm is None else arr[row_perm]


def release_map(reader: Any) -> None:
    """Drop the file map's pages from this process's resident set (MADV_DONTNEED): those
    only copied from (dequantized or concatenated tensors) stay out, those the kept
    views read come back from the page cache at first use. Then hand the freed dense
    staging copies (glibc heap) back to the system."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
