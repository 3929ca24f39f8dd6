"""Per-request RoPE factor sets (Phi-3 longrope past its original context): a request is
rotated with the long set once it is longer than ``rope_switch_tokens``, restarts from
position 0 when it grows past it, and KV computed with one set is never served to a
request using the other (the prefix-cache keys differ)."""

from __future__ import annotations

import pytest

from pagewarden.kv.prefix_hash import encode_extra_keys
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched import Request, Scheduler, SchedulerConfig
from pagewarden.sched.fake_runner import FakeModelRunner

SWITCH = 16


def _sched(**kw) -> Scheduler:
    base = dict(
        num_blocks=32,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
        rope_switch_tokens=SWITCH,
    )
    return Scheduler(SchedulerConfig(**{**base, **kw}))


def _req(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _step(s: Scheduler, runner: FakeModelRunner):
    out = s.schedule()
    s.update(out, runner.execute(out))
    assert s.check_invariants() == []
    return out


def test_config_validates_the_switch() -> None:
    with pytest.raises(ValueError, match="rope_switch_tokens"):
        _sched(rope_switch_tokens=64)
    with pytest.raises(ValueError, match="rope_switch_tokens"):
        _sched(rope_switch_tokens=0)


def test_short_and_long_requests_get_their_set() -> None:
    s = _sched()
    s.add_request(_req("short", list(range(100, 112)), 4))  # 12 + 4 - 1 <= 16 tokens
    s.add_request(_req("long", list(range(200, 217)), 2))  # 17 > 16
    out = _step(s, FakeModelRunner(4, verify=True))
    flags = {r.req_id: r.rope_long for r in out.requests}
    assert flags == {"short": False, "long": True}


def test_request_restarts_with_long_set_when_it_grows_past_the_switch() -> None:
    s = _sched()
    runner = FakeModelRunner(4, verify=True)
    s.add_request(_req("a", list(range(100, 114)), 5))  # 14 tokens: crosses at 17
    seen = []
    while s.has_unfinished_requests():
        out = _step(s, runner)
        seen += [(r.positions, r.rope_long) for r in out.requests]
    assert seen == [
        (range(0, 14), False),  # prompt: 14 tokens
        (range(14, 15), False),  # the sequence is 15 long
        (range(15, 16), False),  # 16: still the short set
        # 17 tokens: every position again with the long set, none of the 4 cached
        # short-set blocks reused
        (range(0, 17), True),
        (range(17, 18), True),
    ]
    assert s.stats().num_preemptions == 0  # a restart is not a preemption
    assert s.stats().prefix_cache_hits == 0


def test_prefix_cache_keeps_the_sets_apart() -> None:
    s = _sched()
    runner = FakeModelRunner(4, verify=True)
    prompt = list(range(100, 112))  # 3 full blocks
    s.add_request(_req("short", prompt, 1))
    _step(s, runner)
    # The same 12 tokens opening a long prompt: no block is shared.
    s.add_request(_req("long", prompt + list(range(300, 308)), 1))
    out = _step(s, runner)
    assert [r.positions for r in out.requests] == [range(0, 20)]
    # The same set reuses: the long prompt again hits 4 blocks, the short one 2.
    s.add_request(_req("long2", prompt + list(range(300, 308)), 1))
    out = _step(s, runner)
    assert [r.positions for r in out.requests] == [range(16, 20)]
    s.add_request(_req("short2", prompt, 1))
    out = _step(s, runner)
    assert [r.positions for r in out.requests] == [range(8, 12)]
    assert [r.rope_long for r in out.requests] == [False]


def test_no_switch_keeps_todays_keys() -> None:
    """Without a switch every request is short and hashed as before."""
    s = _sched(rope_switch_tokens=None)
    s.add_request(_req("a", list(range(100, 140)), 2))
    out = _step(s, FakeModelRunner(4, verify=True))
    assert [r.rope_long for r in out.requests] == [False]
    assert s.requests["a"].extra_keys == encode_extra_keys("", None)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_kv_of_a_request_never_mixes_the_sets(mode: str) -> None:
    """Under preemption (recompute or swap) and chunked prefill, every chunk continues KV
    computed with its own set, or starts from position 0; each chunk's set is the one
    its request's length asks for."""
    s = _sched(num_blocks=12, max_num_batched_tokens=16, preemption_mode=mode, num_host_blocks=16)
    runner = FakeModelRunner(4, verify=True)
    lengths = {"a": 10, "b": 14, "c": 15, "d": 18, "e": 12}
    for rid, n in lengths.items():
        s.add_request(_req(rid, list(range(100 * len(rid) + n, 100 * len(rid) + 2 * n)), 6))
    held: dict[str, bool] = {}  # the set of the KV each request holds
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        for r in out.requests:
            req = s.requests[r.req_id]
            assert r.rope_long == (req.num_tokens > SWITCH), r.req_id
            if r.positions.start == 0:
                held[r.req_id] = r.rope_long
            assert held[r.req_id] == r.rope_long, r.req_id
        s.update(out, runner.execute(out))
        assert s.check_invariants() == []
    assert not s.has_unfinished_requests()
    assert held == {"a": False, "b": True, "c": True, "d": True, "e": True}
    assert s.stats().num_preemptions > 0
    assert (s.stats().swapped_out_blocks > 0) == (mode == "swap")
