"""The step's cap on prefill tokens (``sched/prefill_cap.py``): a step that decodes
carries at most half its decode count (rounded up to whole blocks) of prefill tokens
while the pending prefill work is small; a group gets the whole token budget, at most
once every ``GROUP_SPACING_STEPS`` steps while ``MAX_CHUNK_STEPS`` streams decode, and a part-filled
group waits for more work."""

from __future__ import annotations

import itertools

from pagewarden.sampling_params import SamplingParams
from pagewarden.sched import Request, Scheduler, SchedulerConfig
from pagewarden.sched.fake_runner import FakeModelRunner
from pagewarden.sched.output import SchedulerOutput
from pagewarden.sched.prefill_cap import (
    GROUP_SPACING_STEPS,
    MAX_CHUNK_STEPS,
    QUIET_STEPS,
    prefill_cap,
)

BS = 4
_BASES = itertools.count(1)


def _sched(**kw) -> Scheduler:
    base = dict(
        num_blocks=256, block_size=BS, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128
    )
    return Scheduler(SchedulerConfig(**{**base, **kw}))


def _req(rid: str, n_prompt: int, max_tokens: int = 50) -> Request:
    base = 200 * next(_BASES)  # no two prompts share a prefix (no prefix-cache hit)
    prompt = [base + i for i in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _step(s: Scheduler, runner: FakeModelRunner) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, runner.execute(out))
    assert s.check_invariants() == []
    return out


def _decoding(s: Scheduler, runner: FakeModelRunner, n: int, spaced: bool = True) -> None:
    """Start ``n`` requests and step until all of them decode (and, with ``spaced``, until
    the next step may be a group step)."""
    for i in range(n):
        s.add_request(_req(f"d{i}", 3))
    while s.waiting or any(r.num_computable_tokens - r.num_computed_tokens > 1 for r in s.running):
        _step(s, runner)
    while spaced and s.num_steps + 1 - s.last_group_step < GROUP_SPACING_STEPS:
        _step(s, runner)
    assert len(s.running) == n


def _dec(n: int) -> dict[str, int]:
    return {f"d{i}": 1 for i in range(n)}


def _tokens(out: SchedulerOutput) -> dict[str, int]:
    return {r.req_id: len(r.token_ids) for r in out.requests}


def test_nothing_decoding_no_cap() -> None:
    s = _sched()
    s.add_request(_req("p", 20))
    assert _tokens(_step(s, FakeModelRunner(BS))) == {"p": 20}
    assert s.last_group_step == 1  # an idle engine's prefill step counts as a group step


def test_lone_prompt_beside_decodes_is_chunked_at_half_the_decode_count() -> None:
    s = _sched()
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 6)
    s.add_request(_req("p", 20))
    # 6 decodes -> cap 4 (half of 6 rounded up to a whole block of 4); 20 tokens are 5
    # chunks of 4, no more than min(MAX_CHUNK_STEPS, 6) chunks: small work
    decodes = {f"d{i}": 1 for i in range(6)}
    steps = [_step(s, runner) for _ in range(5)]
    assert [_tokens(o) for o in steps] == [{**decodes, "p": 4}] * 5
    assert [o.requests[-1].sample for o in steps] == [False] * 4 + [True]  # first token
    assert _tokens(_step(s, runner)) == {**decodes, "p": 1}  # then it decodes too


def test_few_decodes_do_not_hold_a_prompt_back() -> None:
    """Chunking delays the prompt by a step per chunk to spare each decoding stream one
    stall: with fewer decodes than chunks it is not worth it; with fewer than
    MAX_CHUNK_STEPS decodes group steps are not spaced either."""
    s = _sched()
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 1)  # cap 4, small up to min(8, 1) chunk: 4 tokens
    s.add_request(_req("p", 20))
    assert _tokens(_step(s, runner)) == {"d0": 1, "p": 20}


def test_a_group_gets_the_whole_budget() -> None:
    s = _sched()
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 6)
    for rid in "abc":
        s.add_request(_req(rid, 30))  # 90 > 6 chunks of 4 tokens: a group
    out = _step(s, runner)
    assert _tokens(out) == {**{f"d{i}": 1 for i in range(6)}, "a": 30, "b": 28}
    assert out.num_batched_tokens == 64  # max_num_batched_tokens, decodes counted


def test_cap_ends_where_the_work_passes_the_chunk_steps() -> None:
    s = _sched()
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 4)  # cap 4: small up to min(8, 4) * 4 = 16 pending tokens
    s.add_request(_req("p", 16))
    s.num_steps += 1  # prefill_cap decides step num_steps (schedule counts it first)
    assert prefill_cap(s) == 4
    s.add_request(_req("q", 1))
    assert prefill_cap(s) == 64
    assert s.last_group_step == s.num_steps


def test_a_group_arriving_lifts_the_cap_on_a_chunked_prompt() -> None:
    s = _sched()
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 6)
    s.add_request(_req("p", 20))
    assert _tokens(_step(s, runner))["p"] == 4  # chunked: 16 tokens left
    for rid in "abc":
        s.add_request(_req(rid, 30))
    out = _step(s, runner)
    # running first: 6 decodes and p's remaining 16, then the group fills the budget
    assert _tokens(out) == {**{f"d{i}": 1 for i in range(6)}, "p": 16, "a": 30, "b": 12}


def test_decodes_are_never_capped() -> None:
    s = _sched(max_num_batched_tokens=16)
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 9)  # cap 8, budget 16: 9 decodes + at most 7 prefill tokens
    s.add_request(_req("p", 10))
    assert _tokens(_step(s, runner)) == {**{f"d{i}": 1 for i in range(9)}, "p": 7}


def test_cap_at_most_the_lowered_budget() -> None:
    s = _sched()
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 6)
    s.set_batch_limits(16, 8)  # the batch controller holds the step down
    s.add_request(_req("p", 20))  # cap 4, but 8 - 6 decodes leaves 2
    assert _tokens(_step(s, runner)) == {**{f"d{i}": 1 for i in range(6)}, "p": 2}


def test_decodes_past_the_seat_limit_do_not_count() -> None:
    s = _sched(max_num_seqs=16)
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 6)
    s.set_batch_limits(2, 64)  # only 2 of the 6 running can be scheduled
    s.add_request(_req("p", 12))
    s.num_steps += 1  # prefill_cap decides step num_steps (schedule counts it first)
    # 2 decodes: cap 4, small up to 2 chunks (8 tokens): 12 is a group (with 6 decodes
    # counted it would be small: 12 <= 6 chunks of 4)
    assert prefill_cap(s) == 64


def test_group_steps_are_spaced() -> None:
    """A group arriving right after a group step is chunked at the cap until
    GROUP_SPACING_STEPS steps have passed, then gets the whole budget."""
    s = _sched()
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 10, spaced=False)  # cap 8 (half of 10, a whole block of 4)
    first = s.last_group_step
    for rid in "abcde":  # 200 tokens: a group (> 8 chunks of 8)
        s.add_request(_req(rid, 40))
    outs = []
    while s.num_steps + 1 < first + GROUP_SPACING_STEPS:
        outs.append(_tokens(_step(s, runner)))
    dec = {f"d{i}": 1 for i in range(10)}
    assert first == 1 and GROUP_SPACING_STEPS == 16
    assert outs == (  # steps 2-16: 8 prefill tokens each, then a and b decode
        [{**dec, "a": 8}] * 5
        + [{**dec, "a": 1, "b": 8}] * 5
        + [{**dec, "a": 1, "b": 1, "c": 8}] * 5
    )
    assert s.last_group_step == first
    out = _step(s, runner)  # GROUP_SPACING_STEPS steps after the last: the whole budget
    assert _tokens(out) == {**dec, "a": 1, "b": 1, "c": 1, "d": 40, "e": 11}
    assert s.last_group_step == first + GROUP_SPACING_STEPS


def test_every_request_finishes_with_the_same_tokens() -> None:
    """The cap changes when tokens are computed, never which: a mixed load drains to
    the same outputs with the cap as a step-by-step greedy fake would give."""
    s = _sched()
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 6)
    for i, n in enumerate([20, 5, 30, 30, 30, 9]):
        s.add_request(_req(f"w{i}", n, max_tokens=7))
    outputs: dict[str, int] = {}
    for _ in range(1000):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        for u in s.update(out, runner.execute(out)):
            outputs[u.req_id] = outputs.get(u.req_id, 0) + len(u.new_token_ids)
        assert out.num_batched_tokens <= 64
        assert s.check_invariants() == []
    assert not s.has_unfinished_requests()
    assert {rid: n for rid, n in outputs.items() if rid.startswith("w")} == {
        f"w{i}": 7 for i in range(6)
    }


def test_a_part_filled_group_waits_for_more_work() -> None:
    """With many decodes, group work under half a step waits (chunked) for more: the next
    requests that come join it, and one stall starts them all once no more come."""
    s = _sched(max_num_batched_tokens=256)
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 10)  # cap 8; small up to 64 tokens; half a step: 123 tokens
    dec = {f"d{i}": 1 for i in range(10)}
    for rid in "ab":
        s.add_request(_req(rid, 40, max_tokens=5))  # 80 tokens: a group, part-filled
    assert [_tokens(_step(s, runner)) for _ in range(4)] == [{**dec, "a": 8}] * 4
    for rid in "cde":
        s.add_request(_req(rid, 40, max_tokens=5))  # 48 + 120 = 168 tokens: over half
    # Over half a step, but the work grew within QUIET_STEPS (requests still arriving).
    for _ in range(QUIET_STEPS):  # chunks of a and b only: c, d and e wait
        assert set(_tokens(_step(s, runner))) - set(dec) <= {"a", "b"}
    out = _step(s, runner)  # nothing more came: one group step starts them all
    b_left = 40 - 8 * (QUIET_STEPS - 1)  # a's last 8 tokens, then b's chunks
    assert _tokens(out) == {**dec, "a": 1, "b": b_left, "c": 40, "d": 40, "e": 40}
    assert s.last_group_step == s.num_steps and s.group_wait_since is None


def test_a_group_with_no_room_for_another_prompt_of_its_size_starts_at_once() -> None:
    s = _sched(max_num_batched_tokens=256)
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 10)  # a full step: 246 tokens
    for i in range(5):
        s.add_request(_req(f"g{i}", 44, max_tokens=5))  # 220 + 44 > 246: full
    out = _step(s, runner)  # still growing, but another 44 would not fit
    assert _tokens(out) == {**_dec(10), **{f"g{i}": 44 for i in range(5)}}
    assert s.last_group_step == s.num_steps and s.group_wait_since is None


def test_a_group_arriving_over_several_steps_starts_in_one_step() -> None:
    """Work that keeps growing waits (chunked) while it does, and starts at once when it
    fills a step: a trickling group costs the decoding streams one stall, not two."""
    s = _sched(max_num_batched_tokens=256)
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 10)  # cap 8; half a step: 123 tokens; a full step: 246
    dec = {f"d{i}": 1 for i in range(10)}
    last = s.last_group_step
    for i in range(4):  # 40 tokens a step: over half a step from the third on
        s.add_request(_req(f"g{i}", 40, max_tokens=5))
        assert _tokens(_step(s, runner)) == {**dec, "g0": 8}
    assert s.last_group_step == last  # still growing: no group step yet
    for i in range(4, 7):
        s.add_request(_req(f"g{i}", 40, max_tokens=5))  # 7 x 40 - 32 = 248 >= 246
    out = _step(s, runner)  # a group step: g0's rest and the prompts the budget holds
    assert _tokens(out) == {**dec, "g0": 8, **{f"g{i}": 40 for i in range(1, 6)}}
    assert s.last_group_step == s.num_steps


def test_a_part_filled_group_waits_at_most_twice_the_spacing() -> None:
    s = _sched(max_num_batched_tokens=512)
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 10)  # cap 8; small up to 64 tokens; half a step: 251 tokens
    for rid in "ab":
        s.add_request(_req(rid, 120, max_tokens=5))  # 240 tokens
    waited = [_tokens(_step(s, runner)) for _ in range(2 * MAX_CHUNK_STEPS)]
    # 16 capped steps: 8 prefill tokens each (a is whole after 15 and decodes in the 16th)
    assert [t.get("a", 0) + t.get("b", 0) for t in waited] == [8] * 15 + [1 + 8]
    out = _step(s, runner)  # then the 112 tokens left go in one group step
    assert _tokens(out) == {**{f"d{i}": 1 for i in range(10)}, "a": 1, "b": 112}
    assert s.last_group_step == s.num_steps


def test_waiting_requests_without_a_seat_are_not_pending_work() -> None:
    s = _sched(max_num_seqs=6)
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 6)
    last = s.last_group_step
    for rid in "abc":
        s.add_request(_req(rid, 30))
    assert _tokens(_step(s, runner)) == {f"d{i}": 1 for i in range(6)}  # no seat: decodes
    assert s.last_group_step == last and s.group_wait_since is None  # no group step taken


def test_few_decodes_no_spacing() -> None:
    s = _sched()
    runner = FakeModelRunner(BS, verify=True)
    _decoding(s, runner, 6, spaced=False)  # 6 < MAX_CHUNK_STEPS streams decode
    for rid in "abc":
        s.add_request(_req(rid, 30))
    out = _step(s, runner)  # the step right after a group step: a group step again
    assert _tokens(out) == {**{f"d{i}": 1 for i in range(6)}, "a": 30, "b": 28}
    assert s.last_group_step == s.num_steps == 2
