"""The CPU path of the content checksums of ``worker/integrity.py``: the C++ kernels of
``kernels/cpu/checksum`` where they built, the torch kernels otherwise.

Same arithmetic as the torch path, bit for bit (``tests/worker/test_integrity.py`` checks
it): signed 32-bit limbs times fixed odd 64-bit keys, summed with wrapping int64, i.e.
mod 2^64. What differs is how the bytes are read: torch gathers the selected rows into
int64 copies and runs one matrix-vector product per layer; the C++ kernels read each
block in place, all layers in one call. ``strict`` re-reads every block a step attends
to, so this is what its cost is made of.

The kernels run on the calling thread: splitting them across threads competes with the
model's own threads for the same cores (measured slower end to end for the torch version
of the same split).
"""

from __future__ import annotations

from typing import Any

import torch

from pagewarden.kernels.cpu import checksum

# Tests turn this off to run the torch kernels on CPU and compare.
enabled = True


def available() -> bool:
    """Whether the C++ kernels run here (built, or buildable on first call)."""
    return checksum.load() is not None


def usable(caches: list[torch.Tensor]) -> bool:
    """True when the C++ kernels can checksum ``caches`` (CPU, contiguous, built)."""
    return (
        enabled
        and caches[0].device.type == "cpu"
        and all(c.is_contiguous() for c in caches)
        and available()
    )


def block_sums(
    caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    limb_keys: torch.Tensor,
    offset_keys: torch.Tensor,
) -> torch.Tensor:
    """Block checksums, the value ``integrity.block_checksums`` defines. (n,) int64."""
    return checksum.block_sums(caches, block_ids, limb_keys, offset_keys)


def slot_sums(
    caches: list[torch.Tensor], slots: torch.Tensor, limb_keys: torch.Tensor
) -> torch.Tensor:
    """Slot checksums, the value ``integrity.slot_checksums`` defines. (n,) int64."""
    return checksum.slot_sums(caches, slots, limb_keys)


def cache_sums(caches: list[torch.Tensor], limb_keys: torch.Tensor) -> Any:
    """``slot_sums`` bound to ``caches`` and ``limb_keys`` once (``checksum.cache_sums``)."""
    return checksum.cache_sums(caches, limb_keys)


def decode_guard(
    caches: list[torch.Tensor], limb_keys: torch.Tensor, offset_keys: torch.Tensor, *state
) -> Any:
    """A decode step's guard work at ``standard`` in two C++ calls around the forward pass,
    bound to one guard's state tensors (``checksum.decode_guard``: sealed, tags, slot
    sums, block sums)."""
    return checksum.decode_guard(caches, limb_keys, offset_keys, *state)
