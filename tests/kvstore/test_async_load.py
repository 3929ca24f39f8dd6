"""Tier loads are asynchronous: a request waits for its load while the rest of the batch
steps on; an aborted or timed-out load leaves nothing behind; outputs stay token-equal."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pagewarden import LLM, SamplingParams
from pagewarden.metrics.prometheus import build_registry, render
from pagewarden.metrics.stats import FrontendStatsRecorder
from tests.kvstore.test_disk_engine import _llm as _disk_llm

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
# 41-token prompts (10 full blocks of 4): the tier is filled with PROMPTS[0]'s blocks by
# a first engine whose later prompts evict them.
PROMPTS = [[3 + (7 * i + j) % 400 for j in range(41)] for i in range(6)]
OTHER = [5 + (11 * j) % 300 for j in range(9)]  # in no tier


class GatedTier:
    """A tier whose ``get`` blocks until ``gate`` is set (a slow or hung disk)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()  # a get is blocked on the gate

    def get(self, key):
        if not self.gate.is_set():
            self.waiting.set()
            self.gate.wait()
        return self.inner.get(key)

    def put(self, key, data):
        return self.inner.put(key, data)

    def delete(self, key):
        self.inner.delete(key)

    def bytes_used(self):
        return self.inner.bytes_used()

    def close(self):
        self.inner.close()


def _llm(model_dir: Path, offload_dir: Path | None, **kw) -> LLM:
    """The disk-engine tests' engine with two seats: one request loads, one decodes."""
    return _disk_llm(model_dir, offload_dir, max_num_seqs=2, **kw)


def _tokens(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    (res,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return list(res.outputs[0].token_ids)


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir) -> dict[str, list[int]]:
    llm = _llm(tiny_llama_dir, None)
    return {"a": _tokens(llm, PROMPTS[0], PARAMS), "other": _tokens(llm, OTHER, LONG)}


@pytest.fixture
def warm_dir(tiny_llama_dir, tmp_path) -> Path:
    first = _llm(tiny_llama_dir, tmp_path)
    for p in PROMPTS:  # each evicts the previous ones' blocks to the tier
        _tokens(first, p, PARAMS)
        assert first.engine.kv_tiers.flush()
    first.engine.kv_tiers.close()
    return tmp_path


def _gated(llm: LLM) -> GatedTier:
    store = llm.engine.kv_tiers
    gated = GatedTier(store.tiers[0])
    store.tiers[0] = gated
    return gated


def _step_collect(engine, out: dict[str, list[int]]) -> None:
    for o in engine.step():
        out[o.request_id] = list(o.outputs[0].token_ids)


def test_a_slow_tier_does_not_stall_the_other_requests_decode(tiny_llama_dir, warm_dir, baseline):
    llm = _llm(tiny_llama_dir, warm_dir, kv_offload_timeout=600.0)
    engine = llm.engine
    gated = _gated(llm)
    out: dict[str, list[int]] = {}
    engine.add_request("other", OTHER, LONG)
    while not out.get("other"):  # its own (missing) load done, it decodes
        _step_collect(engine, out)
    gated.gate.clear()
    engine.add_request("a", PROMPTS[0], PARAMS)
    _step_collect(engine, out)
    assert gated.waiting.wait(60)  # the loader is blocked inside the tier
    before = len(out["other"])
    for _ in range(10):
        _step_collect(engine, out)
    # Ten steps while "a"'s load was pending: "other" decoded a token in each, "a" waited.
    assert len(out["other"]) == before + 10
    assert engine.scheduler.tier_prefix.is_loading("a")
    assert "a" not in out and engine.scheduler.requests["a"].num_computed_tokens == 0
    gated.gate.set()
    while engine.has_unfinished():
        _step_collect(engine, out)
    assert out["a"] == baseline["a"]
    assert out["other"] == baseline["other"]
    assert engine.kv_tiers.counters.hits["disk"] >= 9  # 40 tokens = 10 blocks, minus one
    assert not engine.scheduler.tier_prefix.pending
    assert engine.scheduler.check_invariants() == []


def test_aborting_a_request_while_it_loads_frees_everything(tiny_llama_dir, warm_dir, baseline):
    llm = _llm(tiny_llama_dir, warm_dir, kv_offload_timeout=600.0)
    engine = llm.engine
    gated = _gated(llm)
    pool = engine.scheduler.kv.pool
    free_before = pool.num_free_blocks
    gated.gate.clear()
    engine.add_request("a", PROMPTS[0], PARAMS)
    engine.step()
    assert gated.waiting.wait(60)
    assert engine.scheduler.tier_prefix.is_loading("a")
    assert pool.num_free_blocks == free_before  # a loading request holds no block
    engine.abort_request("a")
    engine.step()
    assert "a" not in engine.scheduler.requests
    assert not engine.scheduler.tier_prefix.pending
    gated.gate.set()  # the loader finishes the cancelled job and drops it
    engine.step()
    assert not engine.has_unfinished()
    assert pool.num_free_blocks == free_before
    assert engine.scheduler.kv.tables == {}
    assert engine.scheduler.check_invariants() == []
    # The engine still serves, and the tier still hits.
    assert _tokens(llm, PROMPTS[0], PARAMS) == baseline["a"]
    assert engine.kv_tiers.counters.hits["disk"] >= 9


def test_a_load_that_hangs_is_a_miss_and_the_request_computes(tiny_llama_dir, warm_dir, baseline):
    llm = _llm(tiny_llama_dir, warm_dir, kv_offload_timeout=0.2)
    gated = _gated(llm)
    gated.gate.clear()  # never answers
    try:
        assert _tokens(llm, PROMPTS[0], PARAMS) == baseline["a"]
        assert llm.engine.kv_tiers.loader.timeouts == 1
        assert llm.engine.kv_tiers.stats().load_timeouts == 1
        text = render(build_registry(llm.engine.stats, FrontendStatsRecorder().snapshot, "m"))[0]
        assert 'pagewarden:kv_tier_load_timeouts_total{model_name="m"} 1.0' in text.decode()
        assert llm.engine.kv_tiers.counters.hits["disk"] == 0
        assert llm.engine.scheduler.check_invariants() == []
    finally:
        gated.gate.set()
