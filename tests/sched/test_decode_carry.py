"""The decode carry (``update`` handing the next all-decode step to ``schedule``) builds
exactly the batch the request-by-request path builds, on workloads that exercise every
reason it must step aside: aborts, preemption, forks, chunked prefill, swapping, rollback."""

from __future__ import annotations

import random

import pytest

from pagewarden.sampling_params import SamplingParams
from pagewarden.sched import Request, Scheduler, SchedulerConfig
from pagewarden.sched.fake_runner import FakeModelRunner
from pagewarden.sched.output import KVFault


class _NoCarry(Scheduler):
    def _carried_decodes(self):
        self._carry = None
        return None


def _twins(cfg: SchedulerConfig) -> tuple[Scheduler, Scheduler]:
    return Scheduler(cfg), _NoCarry(cfg)


def _step_view(out):
    return (
        out.materialized().all_requests(),
        out.copy_blocks,
        out.finished_req_ids,
        out.preempted_req_ids,
        out.swap_out,
        out.swap_in,
    )


@pytest.mark.parametrize("seed", range(24))
def test_carry_and_request_by_request_schedule_identical_steps(seed: int) -> None:
    rng = random.Random(seed)
    swap = rng.random() < 0.5
    # Pools from barely one longest request (17 + 14 tokens) to roomy: preemption is common.
    cfg = SchedulerConfig(
        num_blocks=rng.choice([18, 24, 64]),
        block_size=rng.choice([2, 4]),
        max_num_seqs=rng.choice([3, 6, 16]),
        max_num_batched_tokens=rng.choice([8, 24, 200]),
        max_model_len=48,
        preemption_mode="swap" if swap else "recompute",
        num_host_blocks=12 if swap else 0,
    )
    fast, slow = _twins(cfg)
    runners = (
        FakeModelRunner(cfg.block_size, verify=True),
        FakeModelRunner(cfg.block_size, verify=True),
    )
    shared = [rng.randrange(30) for _ in range(8)]
    pending = []
    for i in range(30):
        prompt = shared[: rng.randint(0, 8)] + [rng.randrange(30) for _ in range(rng.randint(1, 9))]
        params = SamplingParams(
            n=rng.choice([1, 1, 1, 2]), max_tokens=rng.randint(1, 14), ignore_eos=True
        )
        pending.append((f"r{i}", prompt, params))
    for step in range(400):
        if pending and step % 3 == 0:
            for _ in range(rng.randint(1, 4)):
                if pending:
                    rid, prompt, params = pending.pop()
                    for s in (fast, slow):
                        s.add_request(Request(rid, prompt, params))
        if step % 7 == 3 and fast.running:  # abort between steps
            victim = rng.choice(fast.running).req_id
            for s in (fast, slow):
                s.abort_requests([victim])
        computed = [r for r in fast.running if r.num_computed_tokens > 0]
        if step % 11 == 5 and computed:  # a fault: roll a running request back
            req = rng.choice(computed)
            block = fast.kv.tables[req.req_id].ids[(req.num_computed_tokens - 1) // cfg.block_size]
            fault = KVFault("checksum", (block,), {req.req_id: req.num_computed_tokens - 1}, "read")
            for s in (fast, slow):
                s.recover([fault])
                s.release_quarantined(s.quarantined_block_ids())  # scrubbed: back in service
        if not fast.has_unfinished_requests() and not pending:
            break
        outs = [s.schedule() for s in (fast, slow)]
        assert _step_view(outs[0]) == _step_view(outs[1]), f"step {step}"
        ups = [s.update(o, r.execute(o)) for s, o, r in zip((fast, slow), outs, runners)]
        assert (ups[0].req_ids, ups[0].token_ids) == (ups[1].req_ids, ups[1].token_ids)
        assert sorted(ups[0].finished) == sorted(ups[1].finished)
        assert fast.check_invariants() == [] and slow.check_invariants() == []
    assert not fast.has_unfinished_requests() and not slow.has_unfinished_requests()


@pytest.mark.parametrize("num", [8, 12])  # finishing together: deleted in place, rebuilt
def test_carry_is_used_in_a_steady_decode_batch(num: int) -> None:
    cfg = SchedulerConfig(
        num_blocks=64, block_size=4, max_num_seqs=num, max_num_batched_tokens=64, max_model_len=64
    )
    s = Scheduler(cfg)
    runner = FakeModelRunner(4, verify=True)
    for i in range(num):
        last = i == num - 1  # one token longer than the rest
        s.add_request(
            Request(f"r{i}", [i + 1] * 5, SamplingParams(max_tokens=10 + last, ignore_eos=True))
        )
    used, kept_alone = 0, False
    while s.has_unfinished_requests():
        carry = s._carry
        out = s.schedule()
        used += carry is not None and bool(out.decodes.req_ids)
        updates = s.update(out, runner.execute(out))
        if len(updates.finished) == num - 1:  # all but the last: the carry keeps it alone
            assert s._carry is not None and s._carry.req_ids == [f"r{num - 1}"]
            kept_alone = True
    assert kept_alone
    assert used == 10  # every step after the prefill is all decodes
    assert s.kv.num_free_blocks == 63 and s.check_invariants() == []
