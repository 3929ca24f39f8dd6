"""Swap preemption: exact host/device copies, fallback to recompute, aborts, fairness."""

from __future__ import annotations

import pytest

from pagewarden.kv import BlockSwap
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched import Request, RequestStatus, Scheduler, SchedulerConfig
from pagewarden.sched.fake_runner import FakeModelRunner


def _swap_sched(num_host_blocks: int = 4, **kw) -> Scheduler:
    base = dict(
        num_blocks=5,
        block_size=2,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=16,
        preemption_mode="swap",
        num_host_blocks=num_host_blocks,
    )
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def _req(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _step(s: Scheduler, runner: FakeModelRunner, tokens: dict[str, list[int]]):
    out = s.schedule()
    for u in s.update(out, runner.execute(out)):
        tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
    assert s.check_invariants() == []
    return out


def _undisturbed(rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=2, max_model_len=16))
    s.add_request(_req(rid, prompt, max_tokens))
    runner = FakeModelRunner(2, verify=True)
    tokens: dict[str, list[int]] = {}
    while s.has_unfinished_requests():
        _step(s, runner, tokens)
    return tokens[rid]


def test_config_needs_host_blocks_for_swap() -> None:
    with pytest.raises(ValueError, match="num_host_blocks"):
        SchedulerConfig(num_blocks=8, preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(num_blocks=8, preemption_mode="spill")


def test_swap_out_then_in_exact_pairs_and_same_tokens() -> None:
    # 4 usable blocks of 2 slots. a and b: 3 prompt tokens, 4 outputs each.
    s = _swap_sched()
    s.add_request(_req("a", [1, 2, 3], 4))
    s.add_request(_req("b", [7, 8, 9], 4))
    runner = FakeModelRunner(2, verify=True)
    tokens: dict[str, list[int]] = {}

    out1 = _step(s, runner, tokens)  # prefill both
    assert [r.block_table for r in out1.requests] == [[1, 2], [3, 4]]
    _step(s, runner, tokens)  # decode into blocks 2 and 4
    # a needs a third block and the pool is dry: b (admitted last) is swapped out, its
    # two full blocks copied to host blocks 0 and 1; its freed blocks go to a.
    out3 = _step(s, runner, tokens)
    assert out3.preempted_req_ids == ["b"]
    assert out3.swap_out == [BlockSwap(3, 0, 2), BlockSwap(4, 1, 2)]
    assert out3.swap_in == []
    assert [r.req_id for r in out3.requests] == ["a"]
    assert out3.requests[0].block_table == [1, 2, 4]
    b = s.requests["b"]
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 4
    assert s.stats().num_swapped == 1 and s.stats().free_host_blocks == 2

    out4 = _step(s, runner, tokens)  # a's last token; b needs 3 blocks, 1 free
    assert out4.swap_in == [] and [r.req_id for r in out4.requests] == ["a"]
    out5 = _step(s, runner, tokens)  # a finished: b comes back
    assert [(w.src, w.num_slots) for w in out5.swap_in] == [(0, 2), (1, 2)]
    (sr,) = out5.requests
    assert sr.req_id == "b" and sr.positions == range(4, 5)
    assert sr.block_table[:2] == [w.dst for w in out5.swap_in]
    while s.has_unfinished_requests():
        _step(s, runner, tokens)
    assert tokens["a"] == _undisturbed("a", [1, 2, 3], 4)
    assert tokens["b"] == _undisturbed("b", [7, 8, 9], 4)  # resumed, not recomputed
    st = s.stats()
    assert (st.swapped_out_blocks, st.swapped_in_blocks) == (2, 2)
    assert st.free_host_blocks == 4 and st.num_swapped == 0


def test_partial_last_block_swaps_its_used_slots_only() -> None:
    s = _swap_sched(num_blocks=4)  # 3 usable blocks
    s.add_request(_req("a", [1, 2, 3, 4], 3))  # blocks 1, 2 after prefill
    s.add_request(_req("b", [5], 3))  # block 3, one slot used
    runner = FakeModelRunner(2, verify=True)
    tokens: dict[str, list[int]] = {}
    swaps: list[BlockSwap] = []
    while s.has_unfinished_requests():
        swaps += _step(s, runner, tokens).swap_out
    # a's first decode needs a block: b is swapped out holding one token in a block of 2.
    assert swaps[0] == BlockSwap(3, 0, 1)
    assert tokens["b"] == _undisturbed("b", [4], 3)


def _preempt_b(num_host_blocks: int = 4):
    """a and b in 4 usable blocks of 2; after 3 steps b has been preempted for a."""
    s = _swap_sched(num_host_blocks)
    s.add_request(_req("a", [1, 2, 3], 4))
    s.add_request(_req("b", [7, 8, 9], 4))
    runner = FakeModelRunner(2, verify=True)
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        out = _step(s, runner, tokens)
    return s, runner, tokens, out


def test_full_host_tier_falls_back_to_recompute() -> None:
    s, runner, tokens, out = _preempt_b(num_host_blocks=1)  # b needs 2 host blocks
    assert out.preempted_req_ids == ["b"] and out.swap_out == []
    b = s.requests["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    while s.has_unfinished_requests():
        _step(s, runner, tokens)
    assert tokens["b"] == _undisturbed("b", [7, 8, 9], 4)


def test_abort_swapped_request_frees_host_blocks() -> None:
    s, runner, tokens, _ = _preempt_b()
    assert s.requests["b"].status is RequestStatus.SWAPPED
    s.abort_requests(["b"])
    assert "b" not in s.requests and not s.swapped
    assert s.stats().free_host_blocks == 4
    assert s.check_invariants() == []
    while s.has_unfinished_requests():
        _step(s, runner, tokens)
    assert len(tokens["a"]) == 4


def test_swapped_requests_return_before_waiting_ones_start() -> None:
    s, runner, tokens, _ = _preempt_b()
    s.add_request(_req("c", [5], 2))  # fits now (1 block), but b is owed its blocks first
    started: list[str] = []
    while s.has_unfinished_requests():
        out = _step(s, runner, tokens)
        started += [r.req_id for r in out.requests if r.req_id not in started]
    assert started.index("b") < started.index("c")
