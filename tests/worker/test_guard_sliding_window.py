"""Strict integrity with sliding-window layers: the block checksum is a sum over layers,
so a block read by only some layers (those whose window reaches it) cannot be verified
from the kernel's read sums alone. The guard verifies those blocks from the cache, after
the forward pass and before the step's tokens are released; a block no layer read is
not read in that step (the scrubber and reuse checks still cover it).

One request of a 40-token prompt (10 sealed blocks of 4), then a decode with a window of
8 keys (positions 33..40: blocks 8, 9, 10), through the guard exactly as the runner
drives it, on every attention backend.
"""

from __future__ import annotations

import pytest
import torch

from pagewarden.kernels.attention import AttentionMetadata, TorchAttention
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.output import ScheduledRequest, SchedulerOutput
from pagewarden.worker.fused_checks import element_keys, limb_keys, offset_keys
from pagewarden.worker.kv_guard import KVGuard

BS, PROMPT, WINDOW, N_KV, HEAD_DIM = 4, 40, 8, 2, 16
TABLE = list(range(3, 3 + 11))  # 11 blocks: the prompt's 10 and the decode's
PROMPT_IDS = [(7 * p + 3) % 97 for p in range(PROMPT)]


def _ops(backend: str, caches: list[torch.Tensor]):
    if backend == "torch":
        return TorchAttention()
    offsets = offset_keys(BS, torch.device("cpu"))
    if backend == "cpu":
        from pagewarden.kernels.cpu.attention import CpuAttention

        return CpuAttention(caches, limb_keys(caches), offsets)
    from pagewarden.kernels.triton.ops import TritonAttention

    return TritonAttention(caches, element_keys(caches), offsets)


def _request(start: int, stop: int, output: list[int]) -> ScheduledRequest:
    tokens = PROMPT_IDS + output
    return ScheduledRequest(
        req_id="r",
        token_ids=tokens[start:stop],
        positions=range(start, stop),
        block_table=TABLE,
        slot_mapping=[TABLE[p // BS] * BS + p % BS for p in range(start, stop)],
        sample=True,
        sampling_params=SamplingParams(temperature=0.0),
        prompt_token_ids=PROMPT_IDS,
        output_token_ids=output,
    )


def _step(guard, ops, caches, req, step_id, windows):
    """check_reads, bind, per layer write + attend (with its window), after_write."""
    out = SchedulerOutput(step_id, [req])
    faults = guard.check_reads(out)
    meta = AttentionMetadata.build(
        [len(req.token_ids)], [req.positions.start], [TABLE], req.slot_mapping, BS
    )
    guard.bind(out, meta)
    gen = torch.Generator().manual_seed(step_id)
    for cache, window in zip(caches, windows):
        k, v, q = (
            torch.randn(len(req.token_ids), n, HEAD_DIM, generator=gen)
            for n in (N_KV, N_KV, 2 * N_KV)
        )
        ops.write_kv(cache, k, v, meta)
        ops.attend(q, cache, meta, 0.25, sliding_window=window)
    return faults + guard.after_write(out, meta, set())


def _run(backend, windows, corrupt_logical_block):
    caches = [torch.zeros(2, 16, BS, N_KV, HEAD_DIM) for _ in windows]
    guard = KVGuard(caches, BS, "strict", scrub_blocks_per_step=0)  # reads only
    ops = _ops(backend, caches)
    guard.fused_reads = ops.fused_reads
    assert not _step(guard, ops, caches, _request(0, PROMPT, []), 1, windows)
    assert guard.sealed[TABLE[:10]].all()
    if corrupt_logical_block is not None:
        raw = caches[0].view(torch.int32)
        raw[1, TABLE[corrupt_logical_block], 2, 1, 5] ^= 1 << 12  # one bit of V, layer 0
    faults = _step(guard, ops, caches, _request(PROMPT, PROMPT + 1, [11]), 2, windows)
    return guard, faults


BACKENDS = ["torch", "cpu", "triton"]
GEMMA = [WINDOW, None]  # a sliding layer and a global one
MISTRAL = [WINDOW, WINDOW]  # every layer slides


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("windows", [GEMMA, MISTRAL], ids=["gemma", "mistral"])
def test_no_false_alarm_when_layers_read_different_blocks(backend, windows):
    _, faults = _run(backend, windows, None)
    assert faults == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("windows", [GEMMA, MISTRAL], ids=["gemma", "mistral"])
def test_a_corrupted_block_inside_the_window_is_caught_in_the_step(backend, windows):
    _, faults = _run(backend, windows, 9)
    assert [(f.kind, f.block_ids) for f in faults] == [("checksum", (TABLE[9],))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_outside_the_window_a_global_layer_still_reads_it_and_it_is_caught(backend):
    _, faults = _run(backend, GEMMA, 2)
    assert [(f.kind, f.block_ids) for f in faults] == [("checksum", (TABLE[2],))]


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_outside_every_window_nothing_reads_it_and_the_scrubber_finds_it(backend):
    """All layers slide: the block is not read, so no token depends on it and the fused
    step reports nothing; the scrubber (or a reuse) still finds it."""
    guard, faults = _run(backend, MISTRAL, 2)
    assert faults == []
    found = guard.scrub(guard.num_sealed)
    assert [(f.kind, f.block_ids) for f in found] == [("checksum", (TABLE[2],))]
