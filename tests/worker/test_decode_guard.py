"""The guard's decode path (``DecodeGuard``'s two C++ calls at ``standard`` and ``strict``,
with the cpu checking kernel) against its general path: the same tokens, faults, counters
and state after every run, with no fault and with each kind of fault placed in a decode
step.

The general path is what the decode path must reproduce: each run is made twice on the
real tiny Llama, once as shipped and once with ``KVGuard._decode_path`` answering False,
and everything the guard keeps is compared at the end.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core import EngineCore
from pagewarden.faults.kv_faults import corrupt_tag, flip_bit, flip_slot_bit
from pagewarden.models.loader import load_model
from pagewarden.sampling_params import SamplingParams
from pagewarden.worker import integrity_cpu
from pagewarden.worker.integrity import block_checksums
from pagewarden.worker.kv_guard import KVGuard
from pagewarden.worker.step_hooks import StepHooks
from tests.models.tiny_models import make_tiny

BLOCK = 4
FAULTS = ("none", "flip_sealed", "flip_open", "tag", "slot_mapping", "block_index")


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def loaded(request, tiny_llama_dir, tmp_path_factory):
    """The tiny Llama, and a tiny Gemma 3 whose sliding-window layers read only the last
    blocks: a scrub pick they skip is not summed in every layer and is re-read."""
    if request.param == "llama":
        return load_model(tiny_llama_dir, torch.float32)
    path = make_tiny("gemma3", tmp_path_factory.mktemp("tiny_gemma3"))
    return load_model(path, torch.float32)


def _engine(loaded, scrub_blocks_per_step: int, level: str = "standard") -> EngineCore:
    """``level`` integrity on the cpu backend, blocks of ``BLOCK``, prefix caching off."""
    config = EngineConfig(
        model="tiny",
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=64,
        integrity=level,
        enable_prefix_caching=False,
        seed=0,
        attention_backend="cpu",
        scrub_blocks_per_step=scrub_blocks_per_step,
    )
    return EngineCore(config, loaded)


class _Fault(StepHooks):
    """Places one fault in the ``at``-th decode step (after ``bind``, before the forward
    pass) and records every step's faults."""

    def __init__(self, engine: EngineCore, kind: str, at: int) -> None:
        self.engine, self.kind, self.at = engine, kind, at
        self.decodes = 0
        self.steps: list[list[tuple]] = []

    def on_attention_metadata(self, out, meta) -> None:
        if not all(len(r.positions) == 1 for r in out.requests):
            return
        self.decodes += 1
        if self.decodes != self.at or self.kind == "none":
            return
        caches = self.engine.kv_store.caches
        guard = self.engine.runner.guard
        rng = random.Random(7)
        r = max(out.requests, key=lambda r: r.positions.start)  # the longest context
        start = r.positions.start
        if self.kind == "flip_sealed":  # a sealed context block: the scrubber finds it
            block = next(b for b in r.block_table[: start // BLOCK] if bool(guard.sealed[b]))
            flip_bit(caches, block, 1, rng)
        elif self.kind == "flip_open":  # a written slot of the open block: found at seal
            slot = r.block_table[start // BLOCK] * BLOCK + max(start % BLOCK - 1, 0)
            flip_slot_bit(caches, slot, 0, rng)
        elif self.kind == "tag":  # a context slot's tag: the kernel's tag check
            corrupt_tag(guard.tags, r.block_table[0], 1)
        elif self.kind == "slot_mapping":  # the new token written one slot off
            i = list(out.requests).index(r)
            slots = meta.slot_mapping.clone()
            slots[i] = slots[i] + 1 if start % BLOCK < BLOCK - 1 else slots[i] - 1
            meta.slot_mapping = slots
        elif self.kind == "block_index":  # a context block read from another request's
            i = list(out.requests).index(r)
            other = next(q for q in out.requests if q is not r)
            index = meta.block_index.clone()
            index[i * meta.max_blocks] = other.block_table[0]
            meta.block_index = index

    def after_step(self, out, result, updates) -> None:
        self.steps.append(
            [(f.kind, f.block_ids, sorted(f.rollback.items()), f.found_by) for f in result.faults]
        )


def _run(loaded, kind: str, decode_path: bool, monkeypatch, level: str):
    closes = []
    if not decode_path:
        monkeypatch.setattr(KVGuard, "_decode_path", lambda self, reqs: False)
    else:
        close = KVGuard._close_decode

        def counted(self, *a):
            clean = close(self, *a)
            closes.append(clean)
            return clean

        monkeypatch.setattr(KVGuard, "_close_decode", counted)
    engine = _engine(loaded, scrub_blocks_per_step=2, level=level)
    hooks = _Fault(engine, kind, at=6)
    engine.install_hooks(hooks)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), [rng.randrange(3, 500) for _ in range(9 + 4 * i)], params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    monkeypatch.undo()
    guard = engine.runner.guard
    sealed = guard.sealed.nonzero().view(-1)
    # every seal the run left is the checksum of what its block holds
    assert torch.equal(guard.block_sums[sealed], block_checksums(engine.kv_store.caches, sealed))
    state = {
        "sealed": guard.sealed.clone(),
        "block_sums": guard.block_sums.clone(),
        "slot_sums": guard.slot_sums.clone(),
        "tags": guard.tags.tags.clone(),
    }
    return outputs, hooks.steps, dataclasses.asdict(guard.counters), state, closes


#: strict's own checks are on the content: its runs place the content faults (the index
#: faults fail the same C++ checks before strict's and are run at standard).
LEVEL_FAULTS = [("standard", k) for k in FAULTS] + [
    ("strict", k) for k in ("none", "flip_sealed", "flip_open")
]


@pytest.mark.parametrize(("level", "kind"), LEVEL_FAULTS)
def test_the_decode_path_equals_the_general_path(loaded, kind, level, monkeypatch) -> None:
    assert integrity_cpu.available(), "the checksum kernels build where the tests run"
    fast = _run(loaded, kind, True, monkeypatch, level)
    general = _run(loaded, kind, False, monkeypatch, level)
    outputs, steps, counters, state, closes = fast
    assert closes.count(True) >= 10  # the decode path ran, and passed clean steps itself
    assert outputs == general[0]
    assert steps == general[1]
    assert counters == general[2]
    # A rollback's recompute of a prompt in a mixed batch need not give the same floats
    # twice (two runs of the general path differ there too): with a fault, the content
    # sums are held to the checksums of the bytes (in _run) instead of to each other.
    same = ("sealed", "tags") if kind != "none" else tuple(state)
    for name in same:
        assert torch.equal(state[name], general[3][name]), name
    found = [f for step in steps for f in step]
    if kind == "none":
        assert not found and not counters["failures"]
    else:
        assert found, f"{kind}: the fault was not found"
        assert False in closes  # the decode path handed the faulty step to the general one
    assert counters["seals"] > 0 and counters["scrubbed_blocks"] > 0


def test_scrub_picks_equal_the_python_walk(loaded, monkeypatch) -> None:
    """``DecodeGuard.scrub_picks`` picks what the list walk picks, cursor and all."""
    guard = _engine(loaded, scrub_blocks_per_step=3).runner.guard
    assert guard.decode_guard is not None
    rng = random.Random(3)
    for _ in range(50):
        sealed = torch.tensor([rng.random() < 0.2 for _ in range(guard.num_blocks)])
        guard.sealed.copy_(sealed)
        cursor = rng.randrange(guard.num_blocks + 1)
        guard._scrub_cursor = cursor
        fast = (guard._scrub_picks(), guard._scrub_cursor)
        guard._scrub_cursor = cursor
        monkeypatch.setattr(integrity_cpu, "enabled", False)
        slow = (guard._scrub_picks(), guard._scrub_cursor)
        monkeypatch.undo()
        assert fast == slow
