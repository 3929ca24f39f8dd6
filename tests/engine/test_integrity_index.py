"""Integrity where attention actually reads: faults placed only in the index tensors the
forward call uses (``AttentionMetadata.block_index`` / ``slot_mapping``), on the real
tiny Llama and its paged attention, are caught in the step they happen; recovery then
reproduces the fault-free output.

Each test has a control: the same fault with integrity off changes the output, so the
fault is real and a guard that checked some other copy of the mapping would fail here.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core import EngineCore
from pagewarden.models.loader import load_model
from pagewarden.sampling_params import SamplingParams
from pagewarden.worker.step_hooks import StepHooks

BLOCK = 4


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir, torch.float32)


def _engine(loaded, integrity: str, backend: str = "torch") -> EngineCore:
    config = EngineConfig(
        model="tiny",
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=64,
        integrity=integrity,
        enable_prefix_caching=False,
        seed=0,
        attention_backend=backend,
    )
    return EngineCore(config, loaded)


def _workload() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [([rng.randrange(3, 500) for _ in range(9 + 3 * i)], params) for i in range(3)]


class _OneCall(StepHooks):
    """Alters one index tensor of the ``at``-th forward call, and records every step."""

    def __init__(self, engine: EngineCore, at: int, which: str) -> None:
        self.engine, self.at, self.which = engine, at, which
        self.calls = 0
        self.altered: tuple[str, int, int] | None = None  # (req_id, old block, new block)
        self.steps: list[tuple[list, set[str]]] = []  # (faults, req ids given a token)

    def on_attention_metadata(self, out, meta) -> None:
        self.calls += 1
        if self.calls != self.at:
            return
        reqs = out.requests
        self.decode_step = list(reqs)
        k = next(i for i, r in enumerate(reqs) if r.positions.start >= 2 * BLOCK)
        victim = next(r for i, r in enumerate(reqs) if i != k and r.positions.start >= BLOCK)
        target = victim.block_table[0]
        if self.which == "block_index":
            index = meta.block_index.clone()
            old = int(index[k * meta.max_blocks + 1])
            index[k * meta.max_blocks + 1] = target  # context block 1 of request k only
            meta.block_index = index
        else:
            t = sum(len(r.positions) for r in reqs[: k + 1]) - 1  # its last new token
            slots = meta.slot_mapping.clone()
            old = int(slots[t]) // BLOCK
            slots[t] = target * BLOCK + 1  # a written slot of the victim's first block
            meta.slot_mapping = slots
        self.altered = (reqs[k].req_id, old, target)

    def after_step(self, out, result, updates) -> None:
        self.steps.append((list(result.faults), {u.req_id for u in updates}))


def _run(
    loaded, integrity: str, at: int | None = None, which: str = "block_index", backend="torch"
):
    engine = _engine(loaded, integrity, backend)
    hooks = _OneCall(engine, at, which) if at is not None else None
    engine.install_hooks(hooks)
    for i, (ids, params) in enumerate(_workload()):
        engine.add_request(str(i), ids, params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    return engine, hooks, outputs


@pytest.fixture(scope="module")
def clean(loaded):
    return _run(loaded, "off")[2]


@pytest.mark.parametrize("level", ["audit", "standard", "strict"])
def test_block_index_redirect_for_one_call_is_caught_in_that_step(loaded, clean, level) -> None:
    engine, hooks, outputs = _run(loaded, level, at=4, which="block_index")
    rid, old, target = hooks.altered
    faults, sampled = hooks.steps[3]  # the step of the 4th forward call
    tag_faults = [f for f in faults if f.kind == "slot_tag"]
    assert tag_faults and target in tag_faults[0].block_ids, faults
    assert rid in tag_faults[0].rollback
    assert rid not in sampled  # no token released from the step that read wrong K/V
    assert outputs == clean
    assert engine.stats().used_blocks == 0 and engine.scheduler.check_invariants() == []


@pytest.mark.parametrize("level", ["audit", "standard", "strict"])
def test_slot_mapping_redirect_for_one_call_is_caught_in_that_step(loaded, clean, level) -> None:
    engine, hooks, outputs = _run(loaded, level, at=4, which="slot_mapping")
    rid, old, target = hooks.altered
    faults, sampled = hooks.steps[3]
    (fault,) = [f for f in faults if f.kind == "slot_mapping"]
    assert fault.found_by == "write"
    assert {old, target} <= set(fault.block_ids)  # where it should have gone, and went
    assert rid not in sampled
    assert outputs == clean
    assert engine.stats().used_blocks == 0 and engine.scheduler.check_invariants() == []


@pytest.mark.parametrize("level", ["audit", "strict"])
def test_block_index_redirect_in_a_decode_step_is_caught_by_the_cpu_kernel(loaded, clean, level):
    """The cpu backend reads decode K/V through the redirected entry itself and compares
    the tags there in the same loop; the fault is the kernel's (no after-step re-check)."""
    from pagewarden.kernels.cpu import attention as cpu_attention

    assert cpu_attention.load_extension() is not None, cpu_attention.unavailable_reason()
    engine, hooks, outputs = _run(loaded, level, at=4, which="block_index", backend="cpu")
    assert engine.runner.guard.fused_reads
    assert all(r.positions.start > 0 and len(r.positions) == 1 for r in hooks.decode_step)
    rid, old, target = hooks.altered
    faults, sampled = hooks.steps[3]
    (fault,) = [f for f in faults if f.kind == "slot_tag"]
    assert fault.found_by == "read" and "attention kernel" in fault.detail
    assert target in fault.block_ids and rid in fault.rollback
    assert rid not in sampled
    assert outputs == clean
    assert engine.stats().used_blocks == 0 and engine.scheduler.check_invariants() == []


@pytest.mark.parametrize("which", ["block_index", "slot_mapping"])
def test_control_the_same_fault_unchecked_changes_the_output(loaded, clean, which) -> None:
    _, hooks, outputs = _run(loaded, "off", at=4, which=which)
    assert hooks.altered is not None
    assert outputs != clean
