"""Weights in transparent huge pages: the bytes a decode step streams, in one anonymous
map per model, advised ``MADV_HUGEPAGE`` before the first write.

One decode step reads every weight once: at one stream, the step's speed is the memory
bandwidth the GEMV kernels get. With 4 KiB pages the hardware prefetchers stop at every
page boundary and each 4 KiB costs a TLB entry; a 2 MiB page removes both. A GGUF's
quantized weights are otherwise views of the file's map (page-cache pages, never huge),
and the bf16 path's packed tiles come from the allocator in whatever pages it has.

``relocate`` copies tensors into one map (each 64-byte aligned, the map 2 MiB aligned)
and returns the copies; the map is unmapped when the last copy is freed. ``zeros`` gives
the CPU KV pool's layer caches the same kind of map (``worker/kv_store.py``): a decode
step reads each sequence's blocks from all over the pool, and the integrity guard sums
single slots, one TLB miss per 4 KiB page otherwise. Where the
kernel's THP setting is ``never`` (``/sys/kernel/mm/transparent_hugepage/enabled``) the
copies sit in ordinary anonymous pages. ``PAGEWARDEN_HUGEPAGES=0`` turns the move off
(``enabled``). Bench: ``bench/hugepages.py``; docs/quantization.md.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64
#: Tensors smaller than this stay where they are (norm weights, biases).
MIN_BYTES = 64 << 10
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def enabled() -> bool:
    """Whether weights are moved (and the CPU KV pool allocated) in huge pages: a Linux
    mmap with MADV_HUGEPAGE and not ``PAGEWARDEN_HUGEPAGES=0``."""
    return os.environ.get("PAGEWARDEN_HUGEPAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def thp_mode() -> str:
    """The kernel's THP setting (always / madvise / never), or "unknown"."""
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def relocate(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (contiguous CPU tensors) in one new anonymous map advised
    MADV_HUGEPAGE: same dtypes, shapes and values, each 64-byte aligned."""
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("relocate takes contiguous CPU tensors")
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += _round_up(t.numel() * t.element_size(), ALIGN)
    if total == 0:
        return [t.clone() for t in tensors]
    buf, start = _huge_map(total)
    out = []
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        dst = buf[start + off : start + off + n].view(t.dtype).view(t.shape)
        dst.copy_(t)
        out.append(dst)
    return out


def zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """``count`` zeroed tensors of ``shape`` in one new anonymous map advised
    MADV_HUGEPAGE (the KV pool's layer caches). Every page is written here, as
    ``torch.zeros`` would: a serving step must not pay for first touches (a fault
    zeroes a whole 2 MiB page, and with THP ``defrag`` at ``madvise`` it may compact)."""
    elem = torch.empty((), dtype=dtype).element_size()
    each = _round_up(elem * math.prod(shape), ALIGN)
    buf, start = _huge_map(each * count)
    buf[start : start + each * count].zero_()
    return [
        buf[start + i * each : start + i * each + elem * math.prod(shape)].view(dtype).view(shape)
        for i in range(count)
    ]


def _huge_map(total: int) -> tuple[torch.Tensor, int]:
    """A uint8 tensor over a new anonymous map of at least ``total`` bytes past a 2 MiB
    aligned start, and that start; advised MADV_HUGEPAGE from it on. The tensor holds
    the map: it is unmapped with the last view of it."""
    mm = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    start = (-buf.data_ptr()) % HUGE_PAGE
    mm.madvise(mmap.MADV_HUGEPAGE, start, _round_up(total, HUGE_PAGE))
    return buf, start


def release_freed_heap() -> None:
    """Hand the heap the moved tensors left back to the system (glibc ``malloc_trim``)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
