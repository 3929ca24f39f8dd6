"""The cpu backend's C++ K/V write and its one-call decode step against the torch path.

``CpuAttention.write_kv`` must leave the cache and the slot tags byte for byte as
``kernels/attention.write_kv`` does; ``rope_write_decode`` must equal ``cpu_fused.rope``,
then ``write_kv``, then ``attend`` bit for bit (qkv rotated in place, the cache, the tags,
the output and the read checks' verdicts and sums).
"""

from __future__ import annotations

import pytest
import torch

from pagewarden.kernels.attention import AttentionMetadata, write_kv
from pagewarden.kernels.cpu import attention as cpu_attention
from pagewarden.kernels.cpu import fused as cpu_fused
from pagewarden.worker.fused_checks import allocate_read_checks, limb_keys, offset_keys
from tests.kernels.kernel_step import make_step

assert cpu_attention.load_extension() is not None, (
    f"cpu attention extension unavailable: {cpu_attention.unavailable_reason()}; install g++"
)
assert cpu_fused.load() is not None, "the fused CPU ops must build where the tests run"


def _write_case(num_tokens: int, dtype: torch.dtype, seed: int = 0):
    """A cache, K/V as strided views of one qkv output, distinct scattered slots, tags."""
    gen = torch.Generator().manual_seed(seed)
    n_kv, d, bs, num_blocks = 2, 8, 4, num_tokens // 4 + 8
    cache = torch.randn(2, num_blocks, bs, n_kv, d, generator=gen).to(dtype)
    qkv = (
        torch.randn(num_tokens, 5 * n_kv * d, generator=gen).to(dtype).view(num_tokens, 5 * n_kv, d)
    )
    k, v = qkv[:, 3 * n_kv : 4 * n_kv], qkv[:, 4 * n_kv :]  # (T, n_kv, D), strided tokens
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens]
    tags = torch.randint(-(2**62), 2**62, (num_blocks * bs,), generator=gen)
    new_tags = torch.randint(-(2**62), 2**62, (num_tokens,), generator=gen)
    meta = AttentionMetadata.build([num_tokens], [0], [list(range(num_blocks))], slots.tolist(), bs)
    meta.slot_tags, meta.new_tags = tags, new_tags
    return cache, k, v, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 700])  # 700: runs of tokens on the pool
@pytest.mark.parametrize("tags", [True, False])
def test_write_kv_equals_the_torch_path(dtype, num_tokens, tags):
    cache, k, v, meta = _write_case(num_tokens, dtype)
    if not tags:
        meta.slot_tags = meta.new_tags = None
    ref_cache = cache.clone()
    ref_meta = AttentionMetadata(**{**vars(meta), "slot_tags": None})
    if tags:
        ref_meta.slot_tags = meta.slot_tags.clone()
    write_kv(ref_cache, k, v, ref_meta)
    ops = cpu_attention.CpuAttention([cache])
    ops.write_kv(cache, k, v, meta)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    if tags:
        assert torch.equal(meta.slot_tags, ref_meta.slot_tags)


def test_write_kv_slot_named_twice_keeps_the_later_token():
    for num_tokens in (3, 600):
        cache, k, v, meta = _write_case(num_tokens, torch.float32)
        slots = meta.slot_mapping.clone()
        slots[-1] = slots[0]
        meta.slot_mapping = slots
        cpu_attention.CpuAttention([cache]).write_kv(cache, k, v, meta)
        flat = cache.view(2, -1, *cache.shape[3:])
        assert torch.equal(flat[0, slots[0]], k[-1]) and torch.equal(flat[1, slots[0]], v[-1])
        assert int(meta.slot_tags[slots[0]]) == int(meta.new_tags[-1])


def test_write_kv_refuses_a_slot_out_of_range_and_writes_nothing():
    cache, k, v, meta = _write_case(5, torch.bfloat16)
    slots = meta.slot_mapping.clone()
    slots[3] = cache.shape[1] * cache.shape[2]
    meta.slot_mapping = slots
    before, tags = cache.clone(), meta.slot_tags.clone()
    with pytest.raises(IndexError, match="out of bounds"):
        cpu_attention.CpuAttention([cache]).write_kv(cache, k, v, meta)
    assert torch.equal(cache, before) and torch.equal(meta.slot_tags, tags)


def test_write_kv_takes_the_torch_path_for_another_dtype():
    """k, v in float32 over a bf16 cache: rounded into it, as the torch path does."""
    cache, k, v, meta = _write_case(4, torch.bfloat16)
    ref = cache.clone()
    write_kv(ref, k.float(), v.float(), AttentionMetadata(**{**vars(meta)}))
    cpu_attention.CpuAttention([cache]).write_kv(cache, k.float(), v.float(), meta)
    assert torch.equal(cache, ref)


def _decode_case(dtype, context_lens, sums: bool, n_kv=3, group=3, head_dim=64, seed=0):
    """A decode step (one new token per sequence) with tag (and checksum) read checks,
    its qkv output and RoPE rows; the step's K/V not yet written."""
    step = make_step([1] * len(context_lens), context_lens, num_kv_heads=n_kv, group=group,
                     head_dim=head_dim, dtype=dtype, seed=seed)  # fmt: skip
    meta, cache = step.meta, step.caches[0]
    gen = torch.Generator().manual_seed(seed + 1)
    t = len(context_lens)
    qkv = torch.randn(t, (n_kv * group + 2 * n_kv) * head_dim, generator=gen).to(dtype)
    angle = torch.rand(t, 1, head_dim // 2, generator=gen) * 6
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(dtype)
    sin = torch.cat((-angle.sin(), angle.sin()), -1).to(dtype)
    meta.read_checks = _checks(step, sums)
    keys = (limb_keys([cache]), offset_keys(cache.shape[2], "cpu")) if sums else (None, None)
    return step, qkv, cos, sin, keys


def _checks(step, sums: bool):
    n_kv = step.caches[0].shape[3]
    return allocate_read_checks(step.expected_tags, step.meta.max_blocks, n_kv, sums)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sums", [False, True])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, None), (None, 5.0)])
def test_rope_write_decode_equals_rope_write_attend(dtype, sums, window, softcap):
    step, qkv, cos, sin, keys = _decode_case(dtype, [50, 15, 0, 31, 70], sums)
    meta, cache = step.meta, step.caches[0]
    ops = cpu_attention.CpuAttention([cache], *keys)
    features = {"sliding_window": window, "softcap": softcap}
    # The reference: the layer's general path, on copies.
    ref_qkv, ref_cache, ref_tags = qkv.clone(), cache.clone(), meta.slot_tags.clone()
    ref_meta = AttentionMetadata(**{**vars(meta), "slot_tags": ref_tags, "_windowed": {}})
    ref_meta.read_checks = _checks(step, sums)
    n_heads, n_kv, d = 9, 3, 64
    heads = ref_qkv.view(len(qkv), -1, d)
    q, k = cpu_fused.rope(heads[:, : n_heads + n_kv], cos, sin).split([n_heads, n_kv], dim=1)
    v = heads[:, n_heads + n_kv :]
    ref_ops = cpu_attention.CpuAttention([ref_cache], *keys)  # layer 0 too: the same keys
    ref_ops.write_kv(ref_cache, k, v, ref_meta)
    ref = ref_ops.attend(q, ref_cache, ref_meta, 0.125, new_kv=(k, v), **features)
    got = ops.rope_write_decode(qkv, cos, sin, cache, meta, 0.125, **features)
    assert got.shape == (len(qkv), n_heads * d) and got.dtype == dtype
    assert torch.equal(got, ref.reshape(len(qkv), -1))
    assert torch.equal(qkv, ref_qkv)  # q and k rotated in place, as rope_ rotates them
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert torch.equal(meta.slot_tags, ref_tags)
    mine, theirs = meta.read_checks, ref_meta.read_checks
    assert torch.equal(mine.tag_faults, theirs.tag_faults)
    assert not mine.tag_faults.any()  # the step's own tags were written before the reads
    if sums:
        assert torch.equal(mine.read_sums, theirs.read_sums)
        assert torch.equal(mine.read_layers, theirs.read_layers)
        assert mine.read_layers.any()


def test_rope_write_decode_finds_a_bad_tag():
    """A wrong tag in a block the step reads is reported through tag_faults."""
    step, qkv, cos, sin, keys = _decode_case(torch.bfloat16, [40, 9], sums=False)
    meta = step.meta
    tables = meta.block_index.view(meta.num_seqs, meta.max_blocks)
    bs = step.caches[0].shape[2]
    meta.slot_tags[int(tables[0, 1]) * bs + 3] ^= 1  # sequence 0, position 19
    cpu_attention.CpuAttention(step.caches).rope_write_decode(
        qkv, cos, sin, step.caches[0], meta, 0.125
    )
    faults = meta.read_checks.tag_faults
    assert faults[0, 1] == 1 and int(faults.sum()) == 1


def test_rope_write_decode_declines_what_it_does_not_fuse():
    """None, with nothing written, for a step with a prompt row or a wider qkv."""
    step, qkv, cos, sin, _ = _decode_case(torch.bfloat16, [5, 9], sums=False)
    ops = cpu_attention.CpuAttention(step.caches)
    cache = step.caches[0]
    before = cache.clone()
    assert (
        ops.rope_write_decode(qkv.float(), cos.float(), sin.float(), cache, step.meta, 1.0) is None
    )
    prompt = make_step([1, 4], [5, 0], num_kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16)
    t = 5
    assert ops.rope_write_decode(qkv[:1].expand(t, -1).contiguous(), cos[:1].expand(t, -1, -1)
                                 .contiguous(), sin[:1].expand(t, -1, -1).contiguous(),
                                 prompt.caches[0], prompt.meta, 1.0) is None  # fmt: skip
    assert torch.equal(cache, before)
