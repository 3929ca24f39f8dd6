"""The KV cache's content checksums on the CPU (``checksum.cpp``): block sums and slot sums
over every layer, reading each row in place.

Same arithmetic as the torch path of ``worker/integrity.py``, bit for bit (the tests
compare them): signed 32-bit limbs times fixed odd 64-bit keys, summed mod 2^64. The torch
path gathers the selected rows into int64 copies and runs one matrix-vector product per
layer; this one reads each block where it lies, one call for all layers.

Built at first use like the other extensions (``kernels/cpu/build``); ``load()`` is None
where it cannot build or with ``PAGEWARDEN_NO_CPU_EXT=1``: callers keep the torch path.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from pagewarden.kernels.cpu.build import built_once, compile_extension
from pagewarden.kernels.cpu.fused import DISABLE_ENV

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("checksum.cpp")
_CFLAGS = ["-O3", "-march=native"]


@built_once
def load() -> ModuleType | None:
    """The compiled kernels, built on the first call; None where they cannot run here."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes"):
        return None
    try:
        return compile_extension("cpu_checksum", _SOURCE, _CFLAGS)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path runs
        reason = " ".join(str(e).split())[:300]
        log.warning("checksum kernel unavailable, torch runs: %s: %s", type(e).__name__, reason)
        return None


def block_sums(
    caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    limb_keys: torch.Tensor,
    offset_keys: torch.Tensor,
) -> torch.Tensor:
    """(n,) int64: the block checksum of each of ``block_ids`` (IndexError for an id
    outside the pool). ``limb_keys`` (L, 2, limbs per row), ``offset_keys`` (block_size,)."""
    ext = load()
    assert ext is not None, "check load() first"
    return ext.block_sums(caches, block_ids, limb_keys, offset_keys)


def slot_sums(
    caches: list[torch.Tensor], slots: torch.Tensor, limb_keys: torch.Tensor
) -> torch.Tensor:
    """(n,) int64: the slot checksum of each of ``slots`` (flat: block * block_size +
    offset; IndexError for a slot outside the pool)."""
    ext = load()
    assert ext is not None, "check load() first"
    return ext.slot_sums(caches, slots, limb_keys)


def cache_sums(caches: list[torch.Tensor], limb_keys: torch.Tensor) -> Any:
    """``slot_sums`` with ``caches`` and ``limb_keys`` bound (and checked) once: the
    kernel's ``CacheSums``, with ``slot_sums(slots)`` and ``store_slot_sums(slots, into)``
    (``into[slots]`` = their sums; IndexError, nothing written, for a slot outside the pool).
    It keeps the tensors alive."""
    ext = load()
    assert ext is not None, "check load() first"
    return ext.CacheSums(caches, limb_keys)


def decode_guard(
    caches: list[torch.Tensor],
    limb_keys: torch.Tensor,
    offset_keys: torch.Tensor,
    sealed: torch.Tensor,
    tags: torch.Tensor,
    slot_sums: torch.Tensor,
    block_sums: torch.Tensor,
) -> Any:
    """The kernel's ``DecodeGuard`` bound to one guard's caches, keys and state tensors
    (``checksum.cpp`` says what its ``scrub_picks``, ``open`` and ``close`` do); it keeps
    the tensors alive, and the guard changes them in place only."""
    ext = load()
    assert ext is not None, "check load() first"
    return ext.DecodeGuard(caches, limb_keys, offset_keys, sealed, tags, slot_sums, block_sums)
