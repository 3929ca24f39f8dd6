"""Triton kernel: scatter the step's K, V and slot tags through one slot mapping.

Layouts: ``k``, ``v`` (T, n_kv, D), rows contiguous over (n_kv, D) (any token stride);
``cache`` (2, num_blocks, block_size, n_kv, D) contiguous, so slot ``s`` of K is the
row of n_kv * D elements at ``s * n_kv * D`` and V's is ``num_blocks * block_size``
rows further; ``slot_tags`` (num_blocks * block_size,) int64.

Loop order: one program per new token t; it loads ``slot_mapping[t]`` once and writes
K, V and (when tags are on) the token's tag through that one value, so a tag lands
wherever its token's K/V lands (the caller casts K/V to the cache's dtype): the index contract of ``kernels/attention.py``.
Nothing is checked here; ``write_kv`` in ``kernels/attention.py`` is the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_mapping_ptr,
    new_tags_ptr,
    slot_tags_ptr,
    stride_kt,
    stride_vt,
    stride_kv,
    ROW: tl.constexpr,
    ROW_P2: tl.constexpr,
    HAS_TAGS: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    e = tl.arange(0, ROW_P2)
    ok = e < ROW
    k = tl.load(k_ptr + t * stride_kt + e, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + e, mask=ok)
    dst = cache_ptr + slot * ROW + e
    tl.store(dst, k, mask=ok)
    tl.store(dst + stride_kv, v, mask=ok)
    if HAS_TAGS:
        tl.store(slot_tags_ptr + slot, tl.load(new_tags_ptr + t))


def write_kv(
    cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    new_tags: torch.Tensor | None = None,
    slot_tags: torch.Tensor | None = None,
) -> None:
    """Write K, V (T, n_kv, D) and, when given, ``new_tags`` (T,) into ``slot_tags`` at
    ``slot_mapping`` (T,): one kernel, one index tensor."""
    _, num_blocks, block_size, n_kv, head_dim = cache.shape
    assert cache.is_contiguous(), "the cache is addressed by flat slot; it must be contiguous"
    # Rounded by torch, as the reference does (the model's K/V already have the cache's
    # dtype on a GPU; the interpreter's own float32 -> bfloat16 cast truncates).
    k, v = k.to(cache.dtype), v.to(cache.dtype)
    for x in (k, v):
        assert x.shape == (slot_mapping.numel(), n_kv, head_dim), (x.shape, cache.shape)
        assert x.stride(2) == 1 and x.stride(1) == head_dim, "a token's row must be contiguous"
    t = slot_mapping.numel()
    if t == 0:
        return
    tag_args = (slot_mapping, slot_mapping)  # stand-ins when tags are off
    if new_tags is not None:
        assert slot_tags is not None and new_tags.numel() == t
        tag_args = (new_tags, slot_tags)
    row = n_kv * head_dim
    _write_kv_kernel[(t,)](
        k,
        v,
        cache,
        slot_mapping,
        *tag_args,
        k.stride(0),
        v.stride(0),
        num_blocks * block_size * row,
        ROW=row,
        ROW_P2=triton.next_power_of_2(row),
        HAS_TAGS=new_tags is not None,
    )
