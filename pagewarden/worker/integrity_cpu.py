"""CPU kernels for the content checksums of ``worker/integrity.py`` (numba, no compiler).

Same arithmetic as the torch path, bit for bit (``tests/worker/test_integrity.py`` checks
it): signed 32-bit limbs times fixed odd 64-bit keys, summed with wrapping int64, i.e.
mod 2^64. What differs is how the bytes are read:

* torch has no vectorised int64 matrix-vector product on CPU, and the gather before it
  copies every selected row; together ~2.5 ns per 32-bit limb on an AVX2 core.
* These loops read each block in place, one contiguous row per (layer, K/V, block), and
  LLVM vectorises the multiply-add with AVX2: ~0.8 ns per limb, close to the ~0.6 ns a
  plain sum over the same bytes takes (the read itself is the floor).

``strict`` re-reads every block a step attends to, so this is what its cost is made of.

The kernels run on the calling thread: splitting them across threads competes with the
model's own OpenMP threads for the same two cores (measured slower end to end for the
torch version of the same split).
"""

from __future__ import annotations

import functools
import importlib.util
from collections import OrderedDict

import numpy as np
import torch

# numba is a declared dependency; without it the torch kernels run (slower). It is
# imported at the first checksum (``_kernels``), not with this module: its LLVM (~70 MiB
# resident) stays out of an engine that never checksums on the CPU (integrity off, GPU).
AVAILABLE = importlib.util.find_spec("numba") is not None
# Tests turn this off to run the torch kernels on CPU and compare.
enabled = AVAILABLE


def usable(caches: list[torch.Tensor]) -> bool:
    """True when these kernels can checksum ``caches`` (CPU, contiguous, numba present)."""
    return enabled and caches[0].device.type == "cpu" and all(c.is_contiguous() for c in caches)


def _checked_indices(index: torch.Tensor, limit: int, what: str) -> np.ndarray:
    """``index`` as a flat int64 array, every entry in ``[0, limit)``: the kernels do not
    bounds-check, so a wrong id must fail here, as torch's gather would."""
    flat = np.ascontiguousarray(index.to(torch.int64).reshape(-1).numpy())
    if flat.shape[0] and (flat.min() < 0 or flat.max() >= limit):
        raise IndexError(f"{what} out of range [0, {limit}): {flat.min()}..{flat.max()}")
    return flat


@functools.cache
def _kernels():
    """(block sums, slot sums, numba's typed List): numba imported and the loops defined
    on first use."""
    import numba
    from numba.typed import List

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _block_sums_kernel(layers, block_ids, limb_keys, offset_keys, out):  # pragma: no cover
        # layers[l]: (2, num_blocks, block_size, limbs) int32; limb_keys: (L, 2, limbs)
        # int64; offset_keys: (block_size,) int64. int64 arithmetic wraps (mod 2^64).
        block_size = offset_keys.shape[0]
        num_limbs = limb_keys.shape[2]
        slot = np.zeros(block_size, dtype=np.int64)
        for j in range(block_ids.shape[0]):
            b = block_ids[j]
            slot[:] = 0
            for layer in range(len(layers)):
                cache = layers[layer]
                for kv in range(2):
                    keys = limb_keys[layer, kv]
                    block = cache[kv, b]
                    for o in range(block_size):
                        row = block[o]
                        acc = np.int64(0)
                        for i in range(num_limbs):
                            acc += keys[i] * np.int64(row[i])
                        slot[o] += acc
            total = np.int64(0)
            for o in range(block_size):
                total += slot[o] * offset_keys[o]
            out[j] = total

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _slot_sums_kernel(layers, slots, limb_keys, out):  # pragma: no cover
        # Per-slot sums: slot s is row s % block_size of block s // block_size.
        block_size = layers[0].shape[2]
        num_limbs = limb_keys.shape[2]
        for j in range(slots.shape[0]):
            b = slots[j] // block_size
            o = slots[j] % block_size
            acc = np.int64(0)
            for layer in range(len(layers)):
                cache = layers[layer]
                for kv in range(2):
                    keys = limb_keys[layer, kv]
                    row = cache[kv, b, o]
                    for i in range(num_limbs):
                        acc += keys[i] * np.int64(row[i])
            out[j] = acc

    return _block_sums_kernel, _slot_sums_kernel, List


# The numpy views of a cache list, kept for the few lists in use (an engine has one).
_VIEWS: OrderedDict[tuple, object] = OrderedDict()
_MAX_VIEWS = 4


def _layer_views(caches: list[torch.Tensor]):
    """``caches`` as a numba list of (2, num_blocks, block_size, limbs) int32 arrays that
    share the tensors' memory."""
    key = tuple((c.data_ptr(), tuple(c.shape), c.dtype) for c in caches)
    views = _VIEWS.get(key)
    if views is None:
        views = _kernels()[2]()
        for cache in caches:
            two, num_blocks, block_size = cache.shape[:3]
            views.append(cache.view(torch.int32).reshape(two, num_blocks, block_size, -1).numpy())
        _VIEWS[key] = views
        if len(_VIEWS) > _MAX_VIEWS:
            _VIEWS.popitem(last=False)
    else:
        _VIEWS.move_to_end(key)
    return views


def block_sums(
    caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    limb_keys: torch.Tensor,
    offset_keys: torch.Tensor,
) -> torch.Tensor:
    """Block checksums, the value ``integrity.block_checksums`` defines. (n,) int64."""
    ids = _checked_indices(block_ids, caches[0].shape[1], "block id")
    out = np.empty(ids.shape[0], dtype=np.int64)
    if ids.shape[0]:
        _kernels()[0](_layer_views(caches), ids, limb_keys.numpy(), offset_keys.numpy(), out)
    return torch.from_numpy(out)


def slot_sums(
    caches: list[torch.Tensor], slots: torch.Tensor, limb_keys: torch.Tensor
) -> torch.Tensor:
    """Slot checksums, the value ``integrity.slot_checksums`` defines. (n,) int64."""
    flat = _checked_indices(slots, caches[0].shape[1] * caches[0].shape[2], "slot")
    out = np.empty(flat.shape[0], dtype=np.int64)
    if flat.shape[0]:
        _kernels()[1](_layer_views(caches), flat, limb_keys.numpy(), out)
    return torch.from_numpy(out)
