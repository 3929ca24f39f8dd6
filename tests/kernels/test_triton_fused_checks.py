"""Checks fused into the attention kernel: tags and checksums exact, faults found exactly.

The checksum a kernel accumulates as it reads must equal ``integrity.block_checksums``
bit for bit (both the torch and the C++ path), for every cache dtype.
"""

from __future__ import annotations

import pytest
import torch

from pagewarden.kernels.triton.attention import ReadCheckBuffers, paged_attention
from pagewarden.worker import integrity_cpu
from pagewarden.worker.fused_checks import allocate_read_checks, element_keys, offset_keys
from pagewarden.worker.integrity import block_checksums
from tests.kernels.kernel_step import make_step

QUERY_LENS, CONTEXT_LENS = [1, 6, 3], [50, 33, 0]  # decode, chunk over a prefix, fresh


def _read(step, checksums=True, num_splits=None):
    """One attention call per layer, as a step does; returns the shared ReadChecks."""
    n_kv = step.caches[0].shape[3]
    checks = allocate_read_checks(step.expected_tags, step.meta.max_blocks, n_kv, checksums)
    keys = element_keys(step.caches)
    offsets = offset_keys(step.caches[0].shape[2], step.caches[0].device)
    for layer, cache in enumerate(step.caches):
        buffers = ReadCheckBuffers(
            step.slot_tags,
            checks.expected_tags,
            checks.tag_faults,
            checks.read_sums,
            keys[layer],
            offsets,
        )
        paged_attention(
            step.q,
            cache,
            step.block_tables,
            step.meta.seq_info,
            step.meta.max_query_len,
            0.25,
            checks=buffers,
            num_splits=num_splits,
        )
    return checks


def _cached_blocks(step):
    """(sequence, logical block, block id) of every full block inside the cached context."""
    bs = step.caches[0].shape[2]
    return [
        (i, lb, step.tables[i][lb]) for i, ctx in enumerate(CONTEXT_LENS) for lb in range(ctx // bs)
    ]


@pytest.mark.parametrize(
    ("dtype", "num_splits"),
    [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 2), (torch.float16, 1)],
)
def test_checksums_bit_identical_with_the_cpu_path(dtype, num_splits, device, monkeypatch):
    step = make_step(QUERY_LENS, CONTEXT_LENS, num_layers=2, dtype=dtype, device=device)
    checks = _read(step, num_splits=num_splits)
    assert not checks.tag_faults.any()
    got = checks.block_sums()
    cached = _cached_blocks(step)
    assert len(cached) == 5
    ids = torch.tensor([b for _, _, b in cached])
    want = block_checksums(step.caches, ids)
    assert [int(got[i, lb]) for i, lb, _ in cached] == want.tolist()
    if device == "cpu":  # the C++ kernel ran; the torch kernels agree too
        assert integrity_cpu.usable(step.caches)
        monkeypatch.setattr(integrity_cpu, "enabled", False)
        assert block_checksums(step.caches, ids).tolist() == want.tolist()


def test_a_wrong_tag_is_reported_for_exactly_the_blocks_that_read_it(device):
    step = make_step(QUERY_LENS, CONTEXT_LENS, device=device)
    bs = step.caches[0].shape[2]
    # Sequence 1 position 21 (logical block 1) and sequence 0's last cached position.
    step.slot_tags[step.tables[1][1] * bs + 5] += 1
    step.slot_tags[step.tables[0][3] * bs + 1] ^= 1 << 40
    checks = _read(step, checksums=False)
    want = torch.zeros_like(checks.tag_faults)
    want[1, 1] = 1
    want[0, 3] = 1
    assert torch.equal(checks.tag_faults, want)


def test_a_wrong_block_table_entry_is_caught_through_the_kernels_own_index(device):
    """Point sequence 0's block 2 at sequence 1's block 0: intact bytes, wrong place."""
    step = make_step(QUERY_LENS, CONTEXT_LENS, device=device)
    step.meta.block_index[2] = step.tables[1][0]
    checks = _read(step, checksums=False)
    assert checks.tag_faults.nonzero().tolist() == [[0, 2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_flipped_bit_fails_exactly_its_blocks_checksum(dtype, device):
    step = make_step(QUERY_LENS, CONTEXT_LENS, num_layers=2, dtype=dtype, device=device)
    cached = _cached_blocks(step)
    ids = torch.tensor([b for _, _, b in cached])
    sealed = block_checksums(step.caches, ids)
    victim = step.tables[1][1]  # a cached block of the chunked sequence
    raw = step.caches[1].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    raw[1, victim, 7, 1, 3] ^= 1 << 9  # one bit of V, layer 1
    checks = _read(step)
    got = checks.block_sums()
    failed = [b for (i, lb, b), s in zip(cached, sealed.tolist()) if int(got[i, lb]) != s]
    assert failed == [victim]
    assert not checks.tag_faults.any()  # bytes changed, placement did not
