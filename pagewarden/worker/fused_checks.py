"""Glue between ``KVGuard`` and an attention kernel that checks what it reads.

With the Triton backend the attention kernel compares slot tags and (in ``strict``)
accumulates block checksums as it reads K/V (``kernels/paged_attention.py``). This module
builds the kernel's inputs from the guard's state and turns its per-block outputs back
into the guard's terms:

* ``element_keys``: the checksum keys of ``worker/integrity.py`` spread over elements
  (each element takes the key of the 32-bit limb it sits in), one row per layer and K/V;
* ``StepReadChecks``: one step's expected tags (S, kv_len) and output tensors, shared by
  every layer's kernel call;
* ``tag_fault_blocks`` / ``checksum_fault_blocks``: which (sequence, logical block) reads
  failed, for the guard to turn into ``KVFault``s.

The checksum a kernel accumulates is the same function as ``integrity.block_checksums``
(linear mod 2^64, summed over kv heads and layers); ``tests/kernels`` checks it bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def offset_keys(block_size: int, device: torch.device) -> torch.Tensor:
    """(block_size,) int64: the key of each offset within a block."""
    return _offset_keys(block_size, device)


@dataclass
class StepReadChecks:
    """One step's fused-check tensors, shared by every layer's attention call.

    Invariant: ``tag_faults[i, lb]`` is nonzero iff some layer read a slot of sequence
    i's logical block lb whose tag differed from ``expected_tags[i, pos]``;
    ``read_sums[i, h, lb]`` is the sum over layers of kv head h's share of that block's
    checksum (only blocks inside the cached context are complete).
    """

    expected_tags: torch.Tensor  # (S, kv_len) int64
    tag_faults: torch.Tensor  # (S, max_blocks) int32
    read_sums: torch.Tensor | None  # (S, n_kv, max_blocks) int64; None unless strict

    @classmethod
    def allocate(
        cls, expected_tags: torch.Tensor, max_blocks: int, n_kv: int, checksums: bool
    ) -> StepReadChecks:
        s, device = expected_tags.shape[0], expected_tags.device
        return cls(
            expected_tags=expected_tags.contiguous(),
            tag_faults=torch.zeros(s, max_blocks, dtype=torch.int32, device=device),
            read_sums=(
                torch.zeros(s, n_kv, max_blocks, dtype=torch.int64, device=device)
                if checksums
                else None
            ),
        )

    def block_sums(self) -> torch.Tensor:
        """(S, max_blocks) int64: each read block's checksum (sum over kv heads, mod 2^64)."""
        assert self.read_sums is not None
        return self.read_sums.sum(dim=1)
