"""Scheduler unit tests: tiny pools, exact chunks, block ids and copy pairs."""

from __future__ import annotations

import pytest

from pagewarden.sampling_params import SamplingParams
from pagewarden.sched import (
    Request,
    RequestRejected,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
)
from pagewarden.sched.fake_runner import FakeModelRunner
from pagewarden.sched.output import ModelRunnerOutput


def _sched(**kw) -> Scheduler:
    base = dict(
        num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64
    )
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def _req(rid: str, prompt: list[int], **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(rid, prompt, SamplingParams(**params))


def _drain(s: Scheduler, runner: FakeModelRunner | None = None) -> dict[str, list[int]]:
    runner = runner or FakeModelRunner(s.config.block_size, verify=True)
    out_tokens: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        for u in s.update(out, runner.execute(out)):
            out_tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
        assert s.check_invariants() == []
    return out_tokens


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        SchedulerConfig(num_blocks=1)
    with pytest.raises(ValueError, match="block_size"):
        SchedulerConfig(num_blocks=8, block_size=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(num_blocks=8, max_num_batched_tokens=0)


def test_impossible_requests_are_rejected() -> None:
    s = _sched(num_blocks=4, max_model_len=32)
    with pytest.raises(RequestRejected, match="exceeds max_model_len=32"):
        s.add_request(_req("a", list(range(30)), max_tokens=3))
    with pytest.raises(RequestRejected, match="needs up to 4 KV blocks but the pool has only 3"):
        s.add_request(_req("b", list(range(12)), max_tokens=2))
    with pytest.raises(RequestRejected, match="no room"):
        s.add_request(_req("c", list(range(32)), max_tokens=None))
    with pytest.raises(RequestRejected, match="prompt is empty"):
        s.add_request(_req("d", [], max_tokens=1))
    assert isinstance(RequestRejected("x"), ValueError)
    s.add_request(_req("ok", list(range(8)), max_tokens=4))  # 11 positions -> 3 blocks
    with pytest.raises(RequestRejected, match="already in use"):
        s.add_request(_req("ok", [1], max_tokens=1))
    assert s.has_unfinished_requests() and len(s.waiting) == 1


def test_chunked_prefill_then_decode_exact_slots() -> None:
    s = _sched(max_num_batched_tokens=4)
    s.add_request(_req("a", list(range(10, 20)), max_tokens=2))
    runner = FakeModelRunner(4, verify=True)
    chunks = []
    for _ in range(4):
        out = s.schedule()
        (sr,) = out.requests
        chunks.append((sr.positions, sr.sample, sr.block_table, sr.slot_mapping))
        s.update(out, runner.execute(out))
    assert chunks[0] == (range(0, 4), False, [1], [4, 5, 6, 7])
    assert chunks[1] == (range(4, 8), False, [1, 2], [8, 9, 10, 11])
    assert chunks[2] == (range(8, 10), True, [1, 2, 3], [12, 13])
    assert chunks[3] == (range(10, 11), True, [1, 2, 3], [14])
    assert not s.has_unfinished_requests()
    out = s.schedule()
    assert out.finished_req_ids == ["a"] and out.is_empty


def test_decode_and_prefill_share_a_step() -> None:
    s = _sched(max_num_batched_tokens=6)
    runner = FakeModelRunner(4, verify=True)
    s.add_request(_req("a", [1, 2, 3], max_tokens=5))
    out = s.schedule()
    s.update(out, runner.execute(out))
    s.add_request(_req("b", list(range(20)), max_tokens=1))
    out = s.schedule()
    assert [(r.req_id, len(r.token_ids)) for r in out.requests] == [("a", 1), ("b", 5)]
    assert out.num_batched_tokens == 6


def test_prefix_hit_advances_computed_and_leaves_last_token() -> None:
    s = _sched()
    prompt = list(range(100, 112))  # 3 full blocks
    s.add_request(_req("a", prompt, max_tokens=1))
    _drain(s)
    s.add_request(_req("b", prompt, max_tokens=1))
    out = s.schedule()
    (sr,) = out.requests
    assert sr.positions == range(8, 12)  # 2 blocks served; last block recomputed
    assert sr.sample
    res = s.update(out, FakeModelRunner(4).execute(out))
    assert res[0].num_cached_tokens == 8 and res[0].finished
    st = s.stats()
    assert st.prefix_cache_hits == 8 and st.prefix_cache_queries == 8 + 8
    # Another tenant's salt never hits.
    r = Request("c", prompt, SamplingParams(max_tokens=1), cache_salt="tenant-2")
    s.add_request(r)
    out = s.schedule()
    assert out.requests[0].positions == range(0, 12)


def test_preemption_recomputes_most_recent_and_all_finish() -> None:
    # 6 usable blocks of 4; two requests needing 4 blocks each at their end.
    s = _sched(num_blocks=7, max_model_len=32)
    s.add_request(_req("a", list(range(8)), max_tokens=8))
    s.add_request(_req("b", list(range(50, 58)), max_tokens=8))
    runner = FakeModelRunner(4, verify=True)
    seen_preempted = []
    tokens: dict[str, list[int]] = {}
    while s.has_unfinished_requests():
        out = s.schedule()
        seen_preempted += out.preempted_req_ids
        if out.preempted_req_ids:
            assert s.waiting[0].req_id == "b" and s.waiting[0].num_computed_tokens == 0
        for u in s.update(out, runner.execute(out)):
            tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
        assert s.check_invariants() == []
    assert "b" in seen_preempted and s.stats().num_preemptions >= 1
    assert {k: len(v) for k, v in tokens.items()} == {"a": 8, "b": 8}
    # Recompute yields exactly the tokens of an undisturbed run.
    s2 = _sched(num_blocks=64, max_model_len=32)
    s2.add_request(_req("b", list(range(50, 58)), max_tokens=8))
    assert _drain(s2)["b"] == tokens["b"]


def test_parallel_sampling_forks_with_cow_and_seeds() -> None:
    s = _sched()
    s.add_request(
        Request("p", list(range(6)), SamplingParams(n=3, max_tokens=2, seed=7, ignore_eos=True))
    )
    runner = FakeModelRunner(4, verify=True)
    out = s.schedule()
    (sr,) = out.requests
    assert sr.req_id == "p" and sr.positions == range(0, 5) and not sr.sample
    assert list(s.update(out, runner.execute(out))) == []
    assert [r.req_id for r in s.running] == ["p#0", "p#1", "p#2"]
    assert all(r.parent_id == "p" for r in s.running)
    out = s.schedule()
    assert out.finished_req_ids == ["p"]
    # p#0 and p#1 copy the shared last block on write; p#2, by then its only holder,
    # appends to it in place.
    assert [(r.req_id, r.positions, r.seed) for r in out.requests] == [
        ("p#0", range(5, 6), 7 * 1000003 + 0),
        ("p#1", range(5, 6), 7 * 1000003 + 1),
        ("p#2", range(5, 6), 7 * 1000003 + 2),
    ]
    assert out.copy_blocks == [(2, 3), (2, 4)]
    assert [r.block_table for r in out.requests] == [[1, 3], [1, 4], [1, 2]]
    ups = s.update(out, runner.execute(out))
    assert [(u.req_id, u.index, u.parent_id) for u in ups] == [
        ("p#0", 0, "p"),
        ("p#1", 1, "p"),
        ("p#2", 2, "p"),
    ]
    toks = _drain(s, runner)
    assert all(len(v) == 1 for v in toks.values())


def test_abort_parent_aborts_children_and_frees_blocks() -> None:
    s = _sched()
    s.add_request(_req("p", list(range(9)), n=2, max_tokens=5))
    s.add_request(_req("q", list(range(3)), max_tokens=5))
    runner = FakeModelRunner(4, verify=True)
    for _ in range(2):
        out = s.schedule()
        s.update(out, runner.execute(out))
    assert {r.req_id for r in s.running} == {"p#0", "p#1", "q"}
    s.abort_requests(["p", "nope"])
    assert [r.req_id for r in s.running] == ["q"]
    out = s.schedule()
    assert set(out.finished_req_ids) >= {"p#0", "p#1"}
    s.abort_requests(["q", "q"])
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 15 and s.check_invariants() == []


def test_n_gt_1_with_single_token_prompt() -> None:
    s = _sched()
    s.add_request(_req("p", [5], n=2, max_tokens=3))
    toks = _drain(s)
    assert {k: len(v) for k, v in toks.items()} == {"p#0": 3, "p#1": 3}


def test_stop_rules() -> None:
    s = _sched(num_blocks=20)
    eos = frozenset({42})
    # The fake runner's tokens are fixed: find the first two for request "x".
    runner = FakeModelRunner(4)
    first = runner.token_for("x", 3)
    second = runner.token_for("x", 4)
    s.add_request(
        Request("x", [1, 2, 3], SamplingParams(max_tokens=9, stop_token_ids=[second]), eos)
    )
    toks = _drain(s, runner)
    assert toks["x"] == [first, second]
    s.add_request(
        Request(
            "y",
            [1, 2, 3],
            SamplingParams(max_tokens=9, min_tokens=3, stop_token_ids=[runner.token_for("y", 3)]),
        )
    )
    assert len(_drain(s, runner)["y"]) == 9
    s.add_request(
        Request("z", [1, 2, 3], SamplingParams(max_tokens=9), frozenset({runner.token_for("z", 3)}))
    )
    out = s.schedule()
    (u,) = s.update(out, runner.execute(out))
    assert u.finished and u.finish_reason == "stop" and u.stop_reason is None
    s.add_request(Request("w", [1, 2, 3], SamplingParams(max_tokens=None, ignore_eos=True)))
    assert len(_drain(s, runner)["w"]) == 64 - 3


def test_finish_requests_stop_string() -> None:
    s = _sched()
    s.add_request(_req("a", [1, 2, 3], max_tokens=9))
    out = s.schedule()
    s.update(out, ModelRunnerOutput({"a": 7}))
    req = s.requests["a"]
    s.finish_requests(["a"], "STOP")
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert (req.finish_reason, req.stop_reason) == ("stop", "STOP")
    assert not s.has_unfinished_requests() and s.check_invariants() == []


def test_update_skips_requests_gone_since_scheduling() -> None:
    s = _sched(num_blocks=10, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    runner = FakeModelRunner(4)
    for rid in ("a", "b", "c"):
        s.add_request(_req(rid, [1, 2, 3], max_tokens=5))
    out = s.schedule()
    s.update(out, runner.execute(out))
    out = s.schedule()
    assert [(r.req_id, r.slot_mapping) for r in out.requests] == [
        ("a", [7]),
        ("b", [11]),
        ("c", [15]),
    ]
    res = runner.execute(out)
    s.abort_requests(["b"])  # not what the engine does, but update must cope
    ups = s.update(out, res)
    assert [(u.req_id, u.new_token_ids, u.finished) for u in ups] == [
        ("a", [res.sampled_token_ids["a"]], False),
        ("c", [res.sampled_token_ids["c"]], False),
    ]
    assert s.requests["a"].output_token_ids == [runner.token_for("a", 3), runner.token_for("a", 4)]
    assert s.check_invariants() == []


def test_only_fork_children_share_a_partly_filled_block() -> None:
    """Prefix hits share full blocks only; check_invariants catches anything else sharing
    an open block (its next token would overwrite another request's KV)."""
    s = _sched(num_blocks=10, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    runner = FakeModelRunner(4, verify=True)
    s.add_request(_req("a", [1, 2, 3, 4, 5], max_tokens=6))
    s.add_request(Request("p", [1, 2, 3, 4, 5, 6], SamplingParams(n=2, max_tokens=3)))
    for _ in range(2):
        out = s.schedule()
        s.update(out, runner.execute(out))
        assert s.check_invariants() == []
    a_block = s.kv.tables["a"].ids[-1]
    s.kv.pool.blocks[a_block].ref_cnt += 1  # as if something shared a's open block
    assert any("partly filled block" in e for e in s.check_invariants())
    s.kv.pool.blocks[a_block].ref_cnt -= 1
    _drain(s, runner)


def test_slot_mapping_follows_the_block_table() -> None:
    from pagewarden.sched.output import slot_mapping_for

    assert slot_mapping_for([7, 3], 4, 2, 7) == [30, 31, 12, 13, 14]
    assert slot_mapping_for([7], 4, 2, 2) == []
    s = _sched(num_blocks=8, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)
    s.add_request(_req("a", list(range(10)), max_tokens=2))
    (sr,) = s.schedule().requests
    assert sr.block_table == [1, 2, 3] and sr.slot_mapping == list(range(4, 14))
