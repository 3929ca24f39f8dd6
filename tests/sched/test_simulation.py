"""2,000 random requests through the scheduler with a verifying fake runner."""

from __future__ import annotations

import random

import pytest

from pagewarden.sampling_params import SamplingParams
from pagewarden.sched import Request, Scheduler, SchedulerConfig
from pagewarden.sched.fake_runner import FakeModelRunner


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_simulation_2000_requests_with_preemption(mode: str) -> None:
    rng = random.Random(1234)
    # Swap mode: a host tier too small for every victim, so both preemption kinds happen.
    cfg = SchedulerConfig(
        num_blocks=48,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=48,
        max_model_len=64,
        preemption_mode=mode,
        num_host_blocks=24 if mode == "swap" else 0,
    )
    s = Scheduler(cfg)
    runner = FakeModelRunner(cfg.block_size, verify=True)
    shared = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    expected: dict[str, int] = {}
    pending = []
    for i in range(2000):
        prompt = rng.choice(shared)[: rng.randint(0, 12)] + [
            rng.randrange(50) for _ in range(rng.randint(1, 24))
        ]
        n = rng.choice([1, 1, 1, 1, 2, 3])
        mt = rng.randint(1, 16)
        req = Request(
            f"r{i}",
            prompt,
            SamplingParams(n=n, max_tokens=mt, ignore_eos=True, seed=i),
            cache_salt=rng.choice([None, None, "t1"]),
        )
        pending.append(req)
        for rid in [f"r{i}"] if n == 1 else [f"r{i}#{j}" for j in range(n)]:
            expected[rid] = mt
    aborted: set[str] = set()
    got: dict[str, int] = {}
    finished: dict[str, str] = {}
    steps = 0
    while pending or s.has_unfinished_requests():
        for _ in range(rng.randint(0, 4)):
            if pending:
                s.add_request(pending.pop(0))
        if steps % 7 == 0 and s.requests:
            victim = rng.choice(sorted(s.requests))
            s.abort_requests([victim.split("#")[0] if rng.random() < 0.5 else victim])
        out = s.schedule()
        for u in s.update(out, runner.execute(out)):
            got[u.req_id] = got.get(u.req_id, 0) + len(u.new_token_ids)
            if u.finished:
                finished[u.req_id] = u.finish_reason
        if steps % 5 == 0:
            assert s.check_invariants() == []
        steps += 1
        assert steps < 200_000
    aborted = set(expected) - set(finished)
    assert len(finished) > 1500
    for rid, reason in finished.items():
        assert reason == "length" and got[rid] == expected[rid], rid
    for rid in aborted:
        assert got.get(rid, 0) < expected[rid]
    st = s.stats()
    assert st.num_preemptions > 0
    assert st.free_blocks + st.cached_blocks == cfg.num_blocks - 1
    assert st.prefix_cache_hits > 0
    assert s.check_invariants() == []
    if mode == "swap":
        assert st.swapped_out_blocks > 0
        assert st.swapped_in_blocks > 0
        assert st.num_swapped == 0 and st.free_host_blocks == cfg.num_host_blocks
    else:
        assert st.swapped_out_blocks == 0
