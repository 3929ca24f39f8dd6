"""The Triton paged-attention kernel against the plain-torch reference path."""

from __future__ import annotations

import pytest
import torch

from pagewarden.kernels.attention import paged_attention as torch_attention
from pagewarden.kernels.triton.attention import paged_attention as triton_attention
from pagewarden.kernels.triton.attention import query_tiles
from tests.kernels.kernel_step import make_step

CASES = {
    "decode": ([1, 1, 1], [40, 3, 17]),
    "fresh": ([7, 20], [0, 0]),
    "chunk_over_prefix": ([12], [21]),
    "mixed": ([1, 9, 1, 18], [30, 0, 5, 16]),
}


def _run(step, num_splits=None, scale=0.25, tiles=None):
    return triton_attention(
        step.q,
        step.caches[0],
        step.block_tables,
        step.meta.seq_info,
        step.meta.max_query_len,
        scale,
        num_splits=num_splits,
        tiles=tiles,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch(case, device):
    step = make_step(*CASES[case], device=device)
    want = torch_attention(step.q, step.caches[0], step.meta, 0.25)
    torch.testing.assert_close(_run(step), want, atol=1e-5, rtol=1e-5)


def test_launches_only_the_tiles_each_sequence_has(device):
    """Decodes beside a long chunk: one tile each, not the chunk's count each."""
    step = make_step([1, 30, 1], [20, 4, 9], device=device)
    tiles = query_tiles(step.meta.query_lens, group=2).to(device)
    assert tiles.tolist() == [[0, 1, 1, 1, 1, 2], [0, 0, 1, 2, 3, 0]]
    want = torch_attention(step.q, step.caches[0], step.meta, 0.25)
    torch.testing.assert_close(_run(step, tiles=tiles), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 4])
def test_grouped_query_attention(group, device):
    step = make_step([1, 6], [19, 10], group=group, device=device)
    want = torch_attention(step.q, step.caches[0], step.meta, 0.25)
    torch.testing.assert_close(_run(step), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_kv_matches_one_pass(num_splits, device):
    """Flash-decoding: the key range in splits, merged by log-sum-exp; some splits are
    empty for short sequences and for early query tiles."""
    step = make_step([1, 1, 5], [70, 2, 40], device=device)
    want = torch_attention(step.q, step.caches[0], step.meta, 0.25)
    torch.testing.assert_close(_run(step, num_splits), want, atol=1e-5, rtol=1e-5)


def test_bfloat16_within_tolerance(device):
    step = make_step([1, 9], [25, 7], dtype=torch.bfloat16, device=device)
    want = torch_attention(step.q, step.caches[0], step.meta, 0.25).float()
    got = _run(step, num_splits=2).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_reads_in_place_through_the_block_table(device):
    """Rewriting a table entry to another block changes the output exactly as the
    reference's gather does: the kernel reads what the index says, nothing cached."""
    step = make_step([1], [40], device=device)
    step.meta.block_index[1] = step.meta.block_index[0]
    want = torch_attention(step.q, step.caches[0], step.meta, 0.25)
    torch.testing.assert_close(_run(step), want, atol=1e-5, rtol=1e-5)
