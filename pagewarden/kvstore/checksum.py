"""The pool's block checksum (``worker/integrity.py``) over a stored block's bytes, in numpy.

A tier entry's payload is one block, every layer, K then V::

    payload : (num_layers, 2, block_size, num_kv_heads * head_dim * itemsize) bytes
    limbs   : the same bytes as little-endian int32, (L, 2, block_size, limbs_per_row)

    slot_sum[o] = sum_{l, kv, i} m[l, kv, i] * x[l, kv, o, i]     mod 2^64
    block_sum   = sum_o          c[o] * slot_sum[o]               mod 2^64

with the same splitmix64 odd keys as the worker, so the value a tier entry carries is the
one the guard sealed in the pool, and a block that lands in the pool verifies against it.
``tests/kvstore/test_checksum.py`` compares the two bit for bit.
"""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_OFFSET_STREAM = 1 << 40  # the worker's offset-key stream (integrity._OFFSET_STREAM)

_keys: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}


def _splitmix64(index: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = index.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def _odd_keys(start: int, count: int) -> np.ndarray:
    return _splitmix64(np.arange(start, start + count, dtype=np.uint64)) | np.uint64(1)


def _keys_for(num_layers: int, block_size: int, limbs: int) -> tuple[np.ndarray, np.ndarray]:
    key = (num_layers, block_size, limbs)
    found = _keys.get(key)
    if found is None:
        limb_keys = _odd_keys(0, num_layers * 2 * limbs).reshape(num_layers, 2, 1, limbs)
        found = _keys[key] = (limb_keys, _odd_keys(_OFFSET_STREAM, block_size))
    return found


def block_checksum(payload: bytes | memoryview, num_layers: int, block_size: int) -> int:
    """The block checksum of ``payload`` as an unsigned 64-bit int; ``ValueError`` when
    the payload is not ``num_layers * 2 * block_size`` rows of whole 32-bit limbs."""
    n = len(payload)
    rows = num_layers * 2 * block_size
    if n == 0 or n % (rows * 4):
        raise ValueError(f"a payload of {n} bytes is not {rows} rows of 32-bit limbs")
    limbs = n // (rows * 4)
    x = np.frombuffer(payload, dtype="<i4").reshape(num_layers, 2, block_size, limbs)
    limb_keys, offset_keys = _keys_for(num_layers, block_size, limbs)
    with np.errstate(over="ignore"):
        # int32 -> int64 -> uint64 keeps the two's-complement bits: products and sums
        # wrap mod 2^64, as the worker's int64 arithmetic does.
        prod = x.astype(np.int64).view(np.uint64) * limb_keys  # (L, 2, bs, limbs)
        slot_sums = prod.sum(axis=(0, 1, 3), dtype=np.uint64)  # (bs,)
        return int((slot_sums * offset_keys).sum(dtype=np.uint64))


def to_unsigned64(value: int) -> int:
    """The unsigned 64-bit value an int64 (the guard's stored sums) stands for."""
    return value & MASK64
