"""Glue between ``KVGuard`` and an attention kernel that checks what it reads.

With the Triton and cpu backends the attention kernel compares slot tags and (in ``strict``)
accumulates block checksums as it reads K/V (``kernels/triton/attention.py``). This module
builds the kernel's inputs from the guard's state and turns its per-block outputs back
into the guard's terms:

* ``element_keys``: the checksum keys of ``worker/integrity.py`` spread over elements
  (each element takes the key of the 32-bit limb it sits in), one row per layer and K/V;
  ``limb_keys``: the same keys per limb, for kernels that read 32-bit limbs;
* ``allocate_read_checks``: one step's expected tags (S, kv_len) and output tensors
  (``models/paged_attention.ReadChecks``), shared by every layer's kernel call;
  ``sum_only``: limits the cpu kernel's sums to some blocks (``standard``'s scrub picks);
* ``tag_fault_blocks`` / ``checksum_fault_blocks``: which (sequence, logical block) reads
  failed, for the guard to turn into ``KVFault``s.

The checksum a kernel accumulates is the same function as ``integrity.block_checksums``
(linear mod 2^64, summed over kv heads and layers); ``tests/kernels`` checks it bit for bit.
"""

from __future__ import annotations

import torch

from pagewarden.kernels.attention import ReadChecks
from pagewarden.worker.integrity import _limb_keys, _offset_keys


def element_keys(caches: list[torch.Tensor]) -> torch.Tensor:
    """(num_layers, 2, n_kv * D) int64: the limb key of every element of a slot row."""
    _, _, _, n_kv, head_dim = caches[0].shape
    elem = caches[0].element_size()
    assert elem in (2, 4), f"checksums read 16- or 32-bit elements, got {elem}-byte"
    row = n_kv * head_dim
    limbs = _limb_keys(len(caches), row * elem // 4, caches[0].device)  # (L, 2, limbs)
    index = torch.arange(row, device=caches[0].device) * elem // 4  # limb of each element
    return limbs[:, :, index].contiguous()


def limb_keys(caches: list[torch.Tensor]) -> torch.Tensor:
    """(num_layers, 2, limbs per slot row) int64: the key of each 32-bit limb of a slot row
    (for kernels that read the cache as limbs, as ``kernels/cpu/attention_decode.cpp`` does)."""
    _, _, _, n_kv, head_dim = caches[0].shape
    row_bytes = n_kv * head_dim * caches[0].element_size()
    assert row_bytes % 4 == 0, f"a slot row has {row_bytes} bytes; 32-bit limbs need 4k"
    return _limb_keys(len(caches), row_bytes // 4, caches[0].device)


def offset_keys(block_size: int, device: torch.device) -> torch.Tensor:
    """(block_size,) int64: the key of each offset within a block."""
    return _offset_keys(block_size, device)


def allocate_read_checks(
    expected_tags: torch.Tensor, max_blocks: int, num_kv_heads: int, checksums: bool
) -> ReadChecks:
    """Zeroed outputs for one step's fused checks; ``expected_tags`` is (S, kv_len) int64."""
    s, device = expected_tags.shape[0], expected_tags.device
    return ReadChecks(
        expected_tags=expected_tags.contiguous(),
        tag_faults=torch.zeros(s, max_blocks, dtype=torch.int32, device=device),
        read_sums=(
            torch.zeros(s, num_kv_heads, max_blocks, dtype=torch.int64, device=device)
            if checksums
            else None
        ),
        read_layers=(
            torch.zeros(s, max_blocks, dtype=torch.int32, device=device) if checksums else None
        ),
    )


def sum_only(checks: ReadChecks, block_index: torch.Tensor, block_ids: list[int]) -> bool:
    """Ask the cpu kernel (``kernels/cpu/attention_common.h``) to sum only the reads of
    ``block_ids``: every other (sequence, logical block) entry of ``read_layers`` is set to
    -1, which the kernel skips and leaves at -1. ``block_index`` (S * max_blocks,) is the
    step's table the kernel reads through (host memory). Returns whether any entry reads
    one of ``block_ids`` (False: the kernel would sum nothing)."""
    assert checks.read_layers is not None, "sums were not allocated"
    layers = checks.read_layers.numpy().reshape(-1)  # a view: in place
    # Plain lists: the fused scrub runs on steps reading a few dozen blocks, where
    # numpy.isin alone costs more than a whole decode step's other guard work.
    picks = set(block_ids)
    wanted = [i for i, b in enumerate(block_index.tolist()) if b in picks]
    layers.fill(-1)
    layers[wanted] = 0
    return bool(wanted)
