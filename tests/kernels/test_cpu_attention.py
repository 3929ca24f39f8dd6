"""The cpu backend's C++ kernel against the torch path, and its fused read checks.

Attention must equal ``paged_attention`` (``TorchAttention``) on random caches and
scattered block tables: float32 within 1e-5, bfloat16 within one ulp of the exact result
(see ``_check``). The checks must find exactly the (sequence, logical
block) reads that went wrong, and the checksums must equal ``integrity.block_checksums``
bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from pagewarden.kernels.attention import paged_attention
from pagewarden.kernels.cpu import attention as cpu_attention
from pagewarden.worker.fused_checks import (
    allocate_read_checks,
    limb_keys,
    offset_keys,
    sum_only,
)
from pagewarden.worker.integrity import block_checksums
from tests.kernels.kernel_step import make_step

# The C++ extension must build where the tests run (CI installs g++; ninja is a
# dependency): a missing toolchain fails here, it does not skip.
assert cpu_attention.load_extension() is not None, (
    f"cpu attention extension unavailable: {cpu_attention.unavailable_reason()}; install g++"
)

# Decodes of ragged lengths (one block exactly full, one a single key), a chunk over a
# cached prefix and a fresh prompt, in one step.
QUERY_LENS = [1, 1, 6, 1, 3, 1]
CONTEXT_LENS = [50, 15, 33, 0, 0, 7]


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp (8 significant bits) at the magnitude of x."""
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp(min=2**-30))) - 7)


def _check(got: torch.Tensor, q, cache, meta, scale: float) -> None:
    """float32: equal to the torch path within 1e-5. bfloat16:
    - decode rows: within one ulp of the exact result (float32 attention over the same
      bf16 K/V, rounded once; plus 2^-20 of the largest output for float32 sums that
      cancel to near zero), and no further from the torch path than that path is from
      the exact result plus one ulp (torch's bf16 SDPA rounds its probabilities to bf16
      before the V product; the decode kernel does not);
    - fresh rows (the kernel's fresh_attention where the CPU has AVX512-BF16, which also
      keeps its probabilities in float32): the same two bounds;
    - chunked rows (and fresh rows elsewhere) run the torch path itself: equal."""
    ref = paged_attention(q, cache, meta, scale)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if cache.dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        return
    rows = [(n, c) for n, c in zip(meta.query_lens, _context_lens(meta)) for _ in range(n)]
    decode = torch.tensor([n == 1 for n, _ in rows])  # (T,)
    fused_fresh = cpu_attention.load_extension().has_fresh_attention(q.shape[2])
    fresh = torch.tensor([n > 1 and c == 0 and fused_fresh for n, c in rows])
    torch_rows = ~decode & ~fresh
    assert torch.equal(got[torch_rows], ref[torch_rows])
    exact = paged_attention(q.to(cache.dtype).float(), cache.float(), meta, scale)
    kernel = decode | fresh
    g, r, e = got[kernel].float(), ref[kernel].float(), exact[kernel]
    # Plus float32's own summation error, for outputs that cancel down to near zero.
    bound = _ulp(e) + 2**-20 * e.abs().amax()
    assert ((g - e).abs() <= bound).all()
    assert ((g - r).abs() <= (r - e).abs() + bound).all()


def _context_lens(meta) -> list[int]:
    return meta.seq_info[2].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 1, 16), (1, 4, 8), (1, 4, 256)]
)
def test_attention_equals_the_torch_path(dtype, block_size, num_kv_heads, group, head_dim):
    step = make_step(
        QUERY_LENS,
        CONTEXT_LENS,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
    )
    got = cpu_attention.CpuAttention(step.caches).attend(step.q, step.caches[0], step.meta, 0.3)
    _check(got, step.q, step.caches[0], step.meta, 0.3)


@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 2, 128), (1, 4, 256), (2, 2, 256)]
)
def test_fresh_prompts_in_bf16(num_kv_heads, group, head_dim):
    """Fresh prompts across query tiles (1, 16, 17 and 37 tokens; two of 37 in one batch,
    so its tokens are picked through an index) beside decodes and a chunk."""
    step = make_step(
        [37, 1, 16, 37, 5, 1, 17],
        [0, 20, 0, 0, 9, 0, 0],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=torch.bfloat16,
    )
    got = cpu_attention.CpuAttention(step.caches).attend(step.q, step.caches[0], step.meta, 0.2)
    _check(got, step.q, step.caches[0], step.meta, 0.2)


def test_fresh_kernel_is_as_accurate_as_torch_sdpa():
    """Two 128-token prompts: the kernel's median and largest errors against the exact
    result are no worse than torch's bf16 SDPA's (which rounds its probabilities to bf16;
    the kernel does not: that rounding flipped a near-tie of the default model's first
    answer token). Where the CPU lacks AVX512-BF16 the torch path runs instead, and the
    output is torch's exactly."""
    step = make_step([128, 128], [0, 0], num_kv_heads=3, group=3, head_dim=64,
                     dtype=torch.bfloat16)  # fmt: skip
    got = cpu_attention.CpuAttention(step.caches).attend(step.q, step.caches[0], step.meta, 0.125)
    ref = paged_attention(step.q, step.caches[0], step.meta, 0.125)
    if not cpu_attention.load_extension().has_fresh_attention(64):
        assert torch.equal(got, ref)
        return
    exact = paged_attention(step.q.float(), step.caches[0].float(), step.meta, 0.125)
    assert not torch.equal(got, ref)  # the kernel ran, not the torch path
    err, ref_err = (got.float() - exact).abs(), (ref.float() - exact).abs()
    assert err.median() <= ref_err.median() and err.max() <= ref_err.max()


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_splitting_the_key_range_changes_nothing(num_splits, monkeypatch):
    """Small batches split each row's blocks across threads; the merge must be exact."""
    monkeypatch.setattr(cpu_attention, "choose_num_splits", lambda *_: num_splits)
    step = make_step([1, 1], [70, 20], block_size=4, num_kv_heads=3, group=3, head_dim=64)
    got = cpu_attention.CpuAttention(step.caches).attend(step.q, step.caches[0], step.meta, 0.125)
    _check(got, step.q, step.caches[0], step.meta, 0.125)


def test_a_wider_query_is_cast_to_the_cache_dtype_as_the_torch_path_does():
    step = make_step(QUERY_LENS, CONTEXT_LENS, dtype=torch.bfloat16)
    q = step.q.float() + 1e-3  # float32 queries over a bf16 cache
    got = cpu_attention.CpuAttention(step.caches).attend(q, step.caches[0], step.meta, 0.3)
    _check(got, q, step.caches[0], step.meta, 0.3)


def test_split_choice_keeps_threads_busy_without_tiny_splits():
    threads = torch.get_num_threads()
    assert cpu_attention.choose_num_splits(64, 13) == 1
    assert cpu_attention.choose_num_splits(1, 16) == min(4 * threads, 8)
    assert cpu_attention.choose_num_splits(1, 1) == 1


def _read(step, checksums: bool = True):
    """One attend per layer, as a step does; returns the shared ReadChecks."""
    n_kv, bs = step.caches[0].shape[3], step.caches[0].shape[2]
    step.meta.read_checks = allocate_read_checks(
        step.expected_tags, step.meta.max_blocks, n_kv, checksums
    )
    ops = cpu_attention.CpuAttention(step.caches, limb_keys(step.caches), offset_keys(bs, "cpu"))
    for cache in step.caches:
        ops.attend(step.q, cache, step.meta, 0.25)
    return step.meta.read_checks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksums_bit_identical_with_block_checksums(dtype):
    step = make_step(QUERY_LENS, CONTEXT_LENS, num_layers=2, dtype=dtype)
    checks = _read(step)
    assert not checks.tag_faults.any()
    bs = step.caches[0].shape[2]
    cached = [  # full blocks of the cached context: decode and chunked rows alike
        (i, lb, step.tables[i][lb]) for i, ctx in enumerate(CONTEXT_LENS) for lb in range(ctx // bs)
    ]
    assert {i for i, _, _ in cached} == {0, 2}
    want = block_checksums(step.caches, torch.tensor([b for _, _, b in cached]))
    got = checks.block_sums()
    assert [int(got[i, lb]) for i, lb, _ in cached] == want.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_only_sums_exactly_the_blocks_asked_for(dtype):
    """``sum_only`` (standard's scrub picks): the kernel sums and counts the reads of the
    blocks asked for, in decode and chunked rows alike, with the same value as without the
    limit; every other entry stays -1 with no sum."""
    step = make_step(QUERY_LENS, CONTEXT_LENS, num_layers=2, dtype=dtype)
    full = _read(step)
    bs, n_kv = step.caches[0].shape[2], step.caches[0].shape[3]
    picks = [step.tables[0][1], step.tables[2][0], step.tables[0][3]]  # decode, chunked
    checks = allocate_read_checks(step.expected_tags, step.meta.max_blocks, n_kv, True)
    assert sum_only(checks, step.meta.block_index, picks)
    step.meta.read_checks = checks
    ops = cpu_attention.CpuAttention(step.caches, limb_keys(step.caches), offset_keys(bs, "cpu"))
    for cache in step.caches:
        ops.attend(step.q, cache, step.meta, 0.25)
    tables = step.meta.block_index.view(step.meta.num_seqs, step.meta.max_blocks)
    asked = torch.isin(tables, torch.tensor(picks))
    read = full.read_layers > 0
    assert (asked & read).sum() == 3
    assert torch.equal(checks.read_layers[asked & read], full.read_layers[asked & read])
    assert torch.equal(checks.block_sums()[asked & read], full.block_sums()[asked & read])
    assert (checks.read_layers[~asked] == -1).all()
    assert not checks.read_sums.permute(0, 2, 1)[~asked].any()
    assert not sum_only(checks, step.meta.block_index, [10**6])  # nothing reads it


def test_a_redirected_block_index_entry_in_a_decode_row_is_caught():
    """Decode row 0's logical block 1 pointed at row 2's block 0: intact bytes, wrong
    place. The kernel reads through that very entry and flags exactly that read."""
    step = make_step(QUERY_LENS, CONTEXT_LENS)
    step.meta.block_index[0 * step.meta.max_blocks + 1] = step.tables[2][0]
    checks = _read(step, checksums=False)
    assert checks.tag_faults.nonzero().tolist() == [[0, 1]]


def test_wrong_tags_are_reported_for_exactly_the_blocks_that_read_them():
    """A decode row, a chunked row (context and new tokens) and a fresh prompt: the
    kernel checks decode rows as it reads them, ``check_reads`` the others."""
    step = make_step(QUERY_LENS, CONTEXT_LENS)
    bs, tags = step.caches[0].shape[2], step.slot_tags
    tags[step.tables[0][3] * bs + 1] ^= 1 << 40  # decode row 0, position 49
    tags[step.tables[2][1] * bs + 5] += 1  # chunked row 2, cached position 21
    tags[step.tables[2][2] * bs + 2] += 1  # chunked row 2, new position 34
    tags[step.tables[4][0] * bs + 2] += 1  # fresh row 4, position 2
    tags[step.tables[1][0] * bs + 15] += 1  # decode row 1, its one new position 15
    checks = _read(step, checksums=False)
    assert checks.tag_faults.nonzero().tolist() == [[0, 3], [1, 0], [2, 1], [2, 2], [4, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_flipped_bit_fails_exactly_its_blocks_checksum(dtype):
    step = make_step(QUERY_LENS, CONTEXT_LENS, num_layers=2, dtype=dtype)
    victim = step.tables[0][1]  # a cached block of decode row 0
    sealed = block_checksums(step.caches, torch.tensor([victim]))
    raw = step.caches[1].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    raw[1, victim, 7, 1, 3] ^= 1 << 9  # one bit of V, layer 1
    checks = _read(step)
    got = checks.block_sums()
    assert int(got[0, 1]) != int(sealed[0])
    assert int(got[0, 0]) == int(block_checksums(step.caches, torch.tensor([step.tables[0][0]])))
    assert not checks.tag_faults.any()  # bytes changed, placement did not


def test_an_out_of_range_block_id_raises_instead_of_reading_outside_the_cache():
    step = make_step(QUERY_LENS, CONTEXT_LENS)
    step.meta.block_index[1] = step.caches[0].shape[1]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_attention.CpuAttention(step.caches).attend(step.q, step.caches[0], step.meta, 0.3)


def test_an_unavailable_extension_is_a_clear_backend_error(monkeypatch):
    from pagewarden.kernels.backend import AttentionBackendError, check_backend

    check_backend("cpu", "cpu")  # builds here
    monkeypatch.setattr(cpu_attention, "_extension", None)
    monkeypatch.setattr(cpu_attention, "_error", "RuntimeError: no compiler")
    with pytest.raises(AttentionBackendError, match="no compiler.*--attention-backend torch"):
        check_backend("cpu", "cpu")
    with pytest.raises(AttentionBackendError, match="not on cuda"):
        check_backend("cpu", "cuda")
