"""The dashboard snapshot of a live engine: block letters, holders, requests, events."""

from __future__ import annotations

import pickle

from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core import EngineCore
from pagewarden.engine.snapshot import take_snapshot
from pagewarden.faults.injector import FaultInjector
from pagewarden.kv.block_pool import MAX_BLOCK_FAILURES
from pagewarden.sampling_params import SamplingParams


def _core(model_dir, **kw) -> EngineCore:
    cfg = EngineConfig(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=40, **kw)
    return EngineCore(cfg)


def test_letters_holders_and_requests_agree_with_the_pool(tiny_llama_dir) -> None:
    core = _core(tiny_llama_dir, max_num_seqs=2)
    greedy = dict(temperature=0.0, ignore_eos=True)
    core.add_request("pair", list(range(5, 14)), SamplingParams(max_tokens=20, n=2, **greedy))
    for _ in range(4):
        core.step()
    # The children fill the batch (max_num_seqs=2): this one waits.
    core.add_request("late", list(range(20, 30)), SamplingParams(max_tokens=4, **greedy))
    core.step()
    snap = pickle.loads(pickle.dumps(take_snapshot(core)))  # as it crosses the pipe
    stats = core.stats()

    assert len(snap.blocks) == 40 and snap.blocks[0] == "R"
    assert snap.blocks.count("U") + snap.blocks.count("S") == stats.used_blocks
    assert snap.blocks.count("F") == stats.free_blocks
    assert snap.blocks.count("C") == stats.cached_blocks
    # The forked children share their prompt's full blocks: shared, held by both.
    shared = [i for i, letter in enumerate(snap.blocks) if letter == "S"]
    assert shared
    for block_id in shared:
        assert sorted(snap.holders[block_id]) == ["pair#0", "pair#1"]
    for req_id, entry in core.scheduler.kv.tables.items():
        assert all(req_id in snap.holders[b] for b in entry.ids)
    by_id = {r.id: r for r in snap.requests}
    assert by_id["pair#0"].status == "running" and by_id["late"].status == "waiting"
    assert by_id["pair#0"].blocks == len(core.scheduler.kv.tables["pair#0"].ids)
    assert by_id["late"].blocks == 0 and by_id["late"].prompt_tokens == 10
    assert (snap.num_running, snap.num_waiting, snap.num_swapped) == (2, 1, 0)


def test_quarantined_and_retired_blocks(tiny_llama_dir) -> None:
    core = _core(tiny_llama_dir)
    core.claim_ownership()
    pool = core.scheduler.kv.pool
    pool.quarantine(7)
    snap = take_snapshot(core)
    assert snap.blocks[7] == "Q" and snap.quarantines == {7: 1}
    for _ in range(MAX_BLOCK_FAILURES - 1):
        pool.release_quarantine(7)
        pool.quarantine(7)
    snap = take_snapshot(core)
    assert snap.blocks[7] == "X" and snap.quarantines == {7: MAX_BLOCK_FAILURES}


def test_an_injected_fault_is_listed_with_its_blocks_and_rollbacks(tiny_llama_dir) -> None:
    core = _core(tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    core.add_request("a", list(range(5, 15)), params)
    core.step()
    injector = FaultInjector(core, seed=0)
    fault = injector.inject("tag_corruption")
    while core.has_unfinished() and not core.integrity.events:
        core.step()
    [event] = take_snapshot(core).events
    assert (event.kind, event.found_by) == ("slot_tag", "read")
    assert set(event.blocks) == fault.blocks
    assert list(event.rolled_back) == ["a"]
    assert take_snapshot(core).quarantines[event.blocks[0]] == 1
