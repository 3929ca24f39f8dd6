"""Content checksums and slot tags over the physical KV cache."""

from __future__ import annotations

import random

import pytest
import torch

from pagewarden.faults.kv_faults import (
    flip_bit,
    flip_slot_bit,
    redirect_block_table,
    undo_bit_flip,
)
from pagewarden.worker import integrity_cpu
from pagewarden.worker.integrity import (
    MASK64,
    ROOT_TAG,
    KVIntegrityError,
    SlotChecksums,
    SlotTags,
    _limb_keys,
    _offset_keys,
    block_checksums,
    check_blocks,
    combine_slot_checksums,
    seal_blocks,
    slot_checksums,
    token_chain_tags,
    verify_blocks,
    verify_slots,
)

NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, LAYERS = 8, 4, 2, 8, 3
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _caches(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, generator=g).to(dtype)
        for _ in range(LAYERS)
    ]


def _reference_block_sum(caches: list[torch.Tensor], block_id: int) -> int:
    """Pure-Python mod 2^64 evaluation of the documented scheme."""
    limbs_per_row = caches[0][0, 0, 0].numel() * caches[0].element_size() // 4
    keys = [
        [[k & MASK64 for k in row] for row in layer]
        for layer in _limb_keys(len(caches), limbs_per_row, torch.device("cpu")).tolist()
    ]
    block_size = caches[0].shape[2]
    okeys = [k & MASK64 for k in _offset_keys(block_size, torch.device("cpu")).tolist()]
    total = 0
    for o in range(block_size):
        slot = 0
        for layer, cache in enumerate(caches):
            for kv in range(2):
                row = cache[kv, block_id, o].contiguous().view(torch.int32).reshape(-1)
                for i, x in enumerate(row.tolist()):
                    slot += keys[layer][kv][i] * x
        total += okeys[o] * (slot & MASK64)
    total &= MASK64
    return total - (1 << 64) if total >> 63 else total


@pytest.fixture(params=["cpp", "torch"])
def kernel(request, monkeypatch) -> str:
    """Run a test once with the C++ CPU kernels and once with the torch kernels."""
    if request.param == "cpp":
        assert integrity_cpu.available(), "the C++ checksum kernel did not build here"
    monkeypatch.setattr(integrity_cpu, "enabled", request.param == "cpp")
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_pure_python_mod_2_64_reference(dtype: torch.dtype, kernel: str) -> None:
    caches = _caches(dtype)
    assert integrity_cpu.usable(caches) == (kernel == "cpp")
    got = block_checksums(caches, torch.tensor([2, 5])).tolist()
    assert got == [_reference_block_sum(caches, 2), _reference_block_sum(caches, 5)]
    slot_got = slot_checksums(caches, torch.tensor([2 * BLOCK_SIZE + 1]))
    # A block of one slot's content (others zero) has block sum offset_key * slot_sum.
    lone = [torch.zeros_like(c) for c in caches]
    for c, src in zip(lone, caches):
        c[:, 3, 1] = src[:, 2, 1]
    okey = _offset_keys(BLOCK_SIZE, torch.device("cpu"))[1]
    assert int(block_checksums(lone, torch.tensor([3]))) == int(slot_got * okey)


def _both_kernels(caches, ids, slots, monkeypatch) -> None:
    """The C++ and the torch kernels give the same block and slot sums, bit for bit."""
    results = {}
    for on in (True, False):
        monkeypatch.setattr(integrity_cpu, "enabled", on)
        assert integrity_cpu.usable(caches) == on
        results[on] = (block_checksums(caches, ids), slot_checksums(caches, slots))
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


# (heads, dim): rows of 96 (16-bit) or 192 (fp32) limbs, whole AVX-512 steps of 16; 9 or
# 15 limbs (one step of 8, then a scalar tail); 2 or 4 limbs (scalar only).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dim", [(3, 64), (3, 5), (1, 4)])
def test_cpp_and_torch_kernels_agree(dtype: torch.dtype, heads: int, dim: int, monkeypatch) -> None:
    if dtype != torch.float32 and heads * dim % 2:
        dim += 1  # a slot row of 16-bit elements needs an even count for 32-bit limbs
    g = torch.Generator().manual_seed(7)
    # Large values too: limbs near +-2^31 exercise the sign extension and the wrap.
    caches = [(torch.randn(2, 20, 16, heads, dim, generator=g) * 1e30).to(dtype) for _ in range(5)]
    ids = torch.randint(0, 20, (40,), generator=g)  # repeats allowed
    slots = torch.randint(0, 20 * 16, (33,), generator=g)
    _both_kernels(caches, ids, slots, monkeypatch)
    # Blocks at odd offsets and the pool's last block and slot; int32 ids, 2-D ids.
    _both_kernels(
        caches,
        torch.tensor([[19, 1], [7, 0]], dtype=torch.int32),
        torch.tensor([319, 17, 0, 301]),
        monkeypatch,
    )


@pytest.mark.skipif(not integrity_cpu.available(), reason="checksum extension not built")
def test_bound_slot_checksums_equal_the_torch_path_and_store_in_place(monkeypatch) -> None:
    """``SlotChecksums`` (the C++ kernel with the caches bound once) gives
    ``slot_checksums``' values, and ``store`` writes them at the slots, nowhere else; an
    out-of-range slot raises before anything is written."""
    g = torch.Generator().manual_seed(11)
    caches = [(torch.randn(2, 6, 4, 3, 64, generator=g) * 1e30).bfloat16() for _ in range(4)]
    sums = SlotChecksums(caches)
    assert sums._bound is not None
    slots = torch.tensor([23, 0, 9, 9, 17])
    monkeypatch.setattr(integrity_cpu, "enabled", False)
    want = slot_checksums(caches, slots)  # the torch path
    monkeypatch.setattr(integrity_cpu, "enabled", True)
    assert torch.equal(sums(slots), want)
    into = torch.full((24,), 5, dtype=torch.int64)
    sums.store(slots, into)
    assert torch.equal(into[slots], want)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    assert bool((into[untouched] == 5).all())
    before = into.clone()
    with pytest.raises(IndexError):
        sums.store(torch.tensor([3, 24]), into)
    assert torch.equal(into, before)


def test_cpp_kernel_reads_the_int32_limbs_of_any_layout(monkeypatch) -> None:
    # An int32 cache (every limb its own value, extremes included) and a one-layer pool
    # with a block size of 1.
    g = torch.Generator().manual_seed(3)
    caches = [torch.randint(-(2**31), 2**31 - 1, (2, 9, 1, 7), generator=g, dtype=torch.int32)]
    caches[0][0, 4, 0, 0] = -(2**31)
    caches[0][1, 4, 0, 6] = 2**31 - 1
    _both_kernels(caches, torch.arange(9), torch.arange(9).flip(0), monkeypatch)
    monkeypatch.setattr(integrity_cpu, "enabled", True)
    assert block_checksums(caches, torch.tensor([4])).tolist() == [_reference_block_sum(caches, 4)]


def test_without_the_cpp_kernel_the_torch_kernels_run(monkeypatch) -> None:
    # Where the extension cannot build (load() is None), checksums keep the torch path.
    caches = _caches(torch.bfloat16)
    want = block_checksums(caches, torch.tensor([1, 6]))
    monkeypatch.setattr(integrity_cpu.checksum, "load", lambda: None)
    assert not integrity_cpu.usable(caches)
    assert torch.equal(block_checksums(caches, torch.tensor([1, 6])), want)


def test_cpp_kernel_refuses_out_of_range_ids(monkeypatch) -> None:
    caches = _caches(torch.bfloat16)
    monkeypatch.setattr(integrity_cpu, "enabled", True)
    with pytest.raises(IndexError, match="block id"):
        block_checksums(caches, torch.tensor([3, NUM_BLOCKS]))
    with pytest.raises(IndexError, match="slot"):
        slot_checksums(caches, torch.tensor([-1]))
    assert block_checksums(caches, torch.tensor([], dtype=torch.int64)).shape == (0,)
    assert slot_checksums(caches, torch.tensor([], dtype=torch.int64)).shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unmodified_blocks_verify(dtype: torch.dtype) -> None:
    caches = _caches(dtype)
    ids = torch.arange(1, NUM_BLOCKS)
    sealed = block_checksums(caches, ids)
    assert verify_blocks(caches, ids, sealed) == []
    check_blocks(caches, ids, sealed)  # does not raise
    assert torch.equal(block_checksums(caches, ids), sealed)  # deterministic


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_single_bit_flip_changes_block_and_slot_checksum(dtype: torch.dtype) -> None:
    caches = _caches(dtype)
    rng = random.Random(7)
    ids = torch.arange(NUM_BLOCKS)
    all_slots = torch.arange(NUM_BLOCKS * BLOCK_SIZE)
    sealed = block_checksums(caches, ids)
    slot_sums = slot_checksums(caches, all_slots)
    seen = set()
    for _ in range(400):
        block = rng.randrange(1, NUM_BLOCKS)
        flip = flip_bit(caches, block, rng.randrange(LAYERS), rng)
        seen.add((flip.layer, flip.kv, flip.bit))
        assert verify_blocks(caches, ids, sealed) == [block], flip
        slot = block * BLOCK_SIZE + flip.offset
        bad = verify_slots(caches, all_slots, slot_sums)
        assert [(m.block_id, m.offset) for m in bad] == [(block, flip.offset)], flip
        undo_bit_flip(caches, flip)
        assert int(slot_checksums(caches, torch.tensor([slot]))) == int(slot_sums[slot])
    assert len(seen) == LAYERS * 2 * 8  # every layer, K and V, every bit position hit


def test_exhaustive_bit_flips_in_one_slot() -> None:
    """Every bit of one bf16 slot across all layers, K and V."""
    caches = _caches(torch.bfloat16)
    slot = 3 * BLOCK_SIZE + 2
    base = int(slot_checksums(caches, torch.tensor([slot])))
    base_block = int(block_checksums(caches, torch.tensor([3])))
    for layer in range(LAYERS):
        data = caches[layer].view(torch.uint8).view(2, NUM_BLOCKS, BLOCK_SIZE, -1)
        for kv in range(2):
            for byte in range(data.shape[-1]):
                for bit in range(8):
                    data[kv, 3, 2, byte] ^= 1 << bit
                    assert int(slot_checksums(caches, torch.tensor([slot]))) != base
                    assert int(block_checksums(caches, torch.tensor([3]))) != base_block
                    data[kv, 3, 2, byte] ^= 1 << bit


def test_content_only_same_content_other_block_id_same_checksum() -> None:
    caches = _caches(torch.bfloat16)
    for c in caches:
        c[:, 6] = c[:, 2]
    sums = block_checksums(caches, torch.tensor([2, 6]))
    assert int(sums[0]) == int(sums[1])


def test_swapped_slots_change_checksum() -> None:
    caches = _caches(torch.bfloat16)
    before = int(block_checksums(caches, torch.tensor([4])))
    for c in caches:
        c[:, 4, [0, 1]] = c[:, 4, [1, 0]].clone()
    assert int(block_checksums(caches, torch.tensor([4]))) != before


def test_random_multi_byte_corruption_detected_10k_trials() -> None:
    caches = _caches(torch.bfloat16)
    ids = torch.tensor([1])
    sealed = block_checksums(caches, ids)
    pristine = [c.clone() for c in caches]
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    row_bytes = HEADS * DIM * 2
    trials, missed = 10_000, 0
    for _ in range(trials):
        layer = rng.randrange(LAYERS)
        data = caches[layer].view(torch.uint8).view(2, NUM_BLOCKS, BLOCK_SIZE, row_bytes)
        block_bytes = data[:, 1]  # (2, bs, row_bytes)
        flat = block_bytes.reshape(-1)
        n = rng.randrange(2, 33)
        idx = torch.randperm(flat.numel(), generator=gen)[:n]
        noise = torch.randint(1, 256, (n,), dtype=torch.uint8, generator=gen)
        flat[idx] ^= noise  # every picked byte changes
        data[:, 1] = flat.view_as(block_bytes)
        if int(block_checksums(caches, ids)) == int(sealed):
            missed += 1
        caches[layer].copy_(pristine[layer])
    assert missed == 0


def test_seal_from_recorded_slot_sums_and_open_block_flip() -> None:
    caches = _caches(torch.float16)
    slots = torch.arange(2 * BLOCK_SIZE, 3 * BLOCK_SIZE)
    recorded = slot_checksums(caches, slots)  # as written
    sealed = seal_blocks(caches, torch.tensor([2]), recorded.view(1, BLOCK_SIZE))
    assert torch.equal(sealed, block_checksums(caches, torch.tensor([2])))
    assert torch.equal(sealed, combine_slot_checksums(recorded.view(1, BLOCK_SIZE)))
    # A bit flips in a written slot of a still-open block: caught before sealing.
    flip = flip_slot_bit(caches, int(slots[1]), layer=2, rng=random.Random(3))
    bad = verify_slots(caches, slots[:2], recorded[:2])
    assert [(m.block_id, m.offset) for m in bad] == [(2, 1)]
    with pytest.raises(KVIntegrityError) as err:
        seal_blocks(caches, torch.tensor([2]), recorded.view(1, BLOCK_SIZE))
    assert err.value.kind == "checksum" and err.value.block_ids == (2,)
    undo_bit_flip(caches, flip)


def test_check_blocks_raises_with_block_ids() -> None:
    caches = _caches(torch.bfloat16)
    ids = torch.tensor([1, 3, 5])
    sealed = block_checksums(caches, ids)
    flip_bit(caches, 5, 0, random.Random(0))
    with pytest.raises(KVIntegrityError) as err:
        check_blocks(caches, ids, sealed)
    assert err.value.kind == "checksum" and err.value.block_ids == (5,)


# --------------------------------------------------------------------------- slot tags


def _expected(chains: list[list[int]], max_len: int) -> torch.Tensor:
    rows = [token_chain_tags(ROOT_TAG, c, 0) + [0] * (max_len - len(c)) for c in chains]
    return torch.tensor(rows, dtype=torch.int64)


def _slot_mapping(table: list[int], start: int, stop: int) -> list[int]:
    return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, stop)]


def test_token_chain_tags_deterministic_and_chained() -> None:
    a = token_chain_tags(ROOT_TAG, [5, 6, 7, 8], 0)
    assert a == token_chain_tags(ROOT_TAG, [5, 6, 7, 8], 0)
    assert a[2:] == token_chain_tags(a[1], [7, 8], 2)
    assert token_chain_tags(ROOT_TAG, [5, 9, 7, 8], 0)[2:] != a[2:]  # earlier token differs
    assert len(set(a)) == 4


def test_shared_prefix_block_not_flagged_and_redirect_detected() -> None:
    tags = SlotTags(NUM_BLOCKS, BLOCK_SIZE)
    prefix = [10, 11, 12, 13]
    req_a, req_b = prefix + [20, 21], prefix + [30, 31, 32]
    table_a, table_b = [3, 4], [3, 5]  # block 3 is the shared prefix
    tag_a = token_chain_tags(ROOT_TAG, req_a, 0)
    tags.write(torch.tensor(_slot_mapping(table_a, 0, 6)), torch.tensor(tag_a))
    # Request b hits the prefix cache: only its own tokens are written.
    tag_b = token_chain_tags(ROOT_TAG, req_b, 0)
    tags.write(torch.tensor(_slot_mapping(table_b, 4, 7)), torch.tensor(tag_b[4:]))
    tables = torch.tensor([table_a, table_b])
    expected = _expected([req_a, req_b], 7)
    assert tags.verify(tables, [6, 7], expected) == []

    # b's second entry now points at a's block (another request's tokens).
    bad_table = list(table_b)
    redirect_block_table(bad_table, 1, 4)
    mismatches = tags.verify(torch.tensor([table_a, bad_table]), [6, 7], expected)
    assert {(m.seq_index, m.position, m.block_id) for m in mismatches} == {
        (1, 4, 4),
        (1, 5, 4),
        (1, 6, 4),
    }
    with pytest.raises(KVIntegrityError) as err:
        tags.check(torch.tensor([table_a, bad_table]), [6, 7], expected)
    assert err.value.kind == "slot_tag" and err.value.block_ids == (4,)

    # Pointing at a never-written (free) block is caught too.
    assert tags.verify(torch.tensor([[3, 6]]), [6], expected[:1])


def test_wrong_slot_index_detected() -> None:
    tags = SlotTags(NUM_BLOCKS, BLOCK_SIZE)
    tokens = [1, 2, 3, 4, 5]
    table = [2, 6]
    chain = token_chain_tags(ROOT_TAG, tokens, 0)
    tags.write(torch.tensor(_slot_mapping(table, 0, 4)), torch.tensor(chain[:4]))
    # Decode step writes token 4 into offset 1 of block 6 instead of offset 0.
    tags.write(torch.tensor([6 * BLOCK_SIZE + 1]), torch.tensor(chain[4:]))
    bad = tags.verify(torch.tensor([table]), [5], _expected([tokens], 5))
    assert [(m.seq_index, m.position, m.block_id) for m in bad] == [(0, 4, 6)]


def test_same_tokens_shifted_position_detected() -> None:
    """A block holding the right tokens at the wrong positions is flagged."""
    tags = SlotTags(NUM_BLOCKS, BLOCK_SIZE)
    tokens = [7] * 8
    chain = token_chain_tags(ROOT_TAG, tokens, 0)
    tags.write(torch.tensor(_slot_mapping([1, 2], 0, 8)), torch.tensor(chain))
    bad = tags.verify(torch.tensor([[2, 1]]), [8], _expected([tokens], 8))
    assert len(bad) == 8
