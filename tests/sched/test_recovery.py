"""Scheduler-side integrity: recovery, stale-ref detection, retirement, ownership.

Pure Python over tiny pools with exact block ids, as in ``test_scheduler.py``.
"""

from __future__ import annotations

import threading

import pytest

from pagewarden.kv.block import BlockState
from pagewarden.kv.block_pool import MAX_BLOCK_FAILURES
from pagewarden.kv.errors import BlockStateError, KVOwnershipError
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched import Request, Scheduler, SchedulerConfig
from pagewarden.sched.fake_runner import FakeModelRunner
from pagewarden.sched.output import KVFault


def _sched(**kw) -> Scheduler:
    base = dict(
        num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64
    )
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def _req(rid: str, prompt: list[int], max_tokens: int = 6) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _steps(s: Scheduler, runner: FakeModelRunner, n: int) -> None:
    for _ in range(n):
        out = s.schedule()
        s.update(out, runner.execute(out))


def _drain(s: Scheduler, runner: FakeModelRunner) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while s.has_unfinished_requests():
        out = s.schedule()
        for u in s.update(out, runner.execute(out)):
            tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
        assert s.check_invariants() == []
    return tokens


def _two_sharing_a_prefix(s: Scheduler, runner: FakeModelRunner) -> list[int]:
    """'a' and 'b' share two full prompt blocks through the prefix cache."""
    prompt = list(range(100, 109))  # blocks of 4: [100..103] [104..107] [108]
    s.add_request(_req("a", prompt))
    _steps(s, runner, 2)
    s.add_request(_req("b", prompt))
    _steps(s, runner, 1)
    shared = s.kv.tables["a"].ids[:2]
    assert s.kv.tables["b"].ids[:2] == shared
    return shared


def test_recover_quarantines_rolls_back_every_holder_and_releases() -> None:
    s = _sched()
    runner = FakeModelRunner(4, verify=True)
    bad = _two_sharing_a_prefix(s, runner)[1]
    computed = {r.req_id: r.num_computed_tokens for r in s.running}
    report = s.recover([KVFault("checksum", (bad,), {}, "scrub")])
    assert report.quarantined == (bad,)
    assert report.rolled_back == {"a": 4, "b": 4}  # start of the bad block
    assert report.recomputed_tokens == sum(c - 4 for c in computed.values())
    assert not report.unrecoverable
    pool = s.kv.pool
    assert pool.blocks[bad].state is BlockState.QUARANTINED
    assert pool.blocks[bad].block_hash is None  # prefix entry dropped
    assert bad not in s.kv.tables["a"].ids and bad not in s.kv.tables["b"].ids
    assert s.check_invariants() == []
    assert s.quarantined_block_ids() == [bad]  # nobody holds it now
    s.release_quarantined([bad])
    assert pool.blocks[bad].state is BlockState.FREE
    # The rolled-back requests recompute (the fake runner verifies every table reads back
    # its own tokens) and finish with the tokens they would have had.
    tokens = _drain(s, runner)
    clean = _sched()
    clean_runner = FakeModelRunner(4, verify=True)
    _two_sharing_a_prefix(clean, clean_runner)
    assert tokens == _drain(clean, clean_runner)
    assert s.stats().used_blocks == 0


def test_recover_uses_the_earliest_rollback_a_fault_names() -> None:
    s = _sched()
    runner = FakeModelRunner(4)
    s.add_request(_req("a", list(range(10, 23))))  # 13 tokens: 3 full blocks
    _steps(s, runner, 2)
    first = s.kv.tables["a"].ids[0]
    report = s.recover([KVFault("slot_tag", (first,), {"a": 0}, "read")])
    assert report.rolled_back == {"a": 0}
    assert s.kv.tables["a"].ids == [] and s.requests["a"].num_computed_tokens == 0
    assert s.check_invariants() == []


def test_use_after_free_is_caught_before_the_step_reads_it() -> None:
    s = _sched()
    runner = FakeModelRunner(4, verify=True)
    s.add_request(_req("a", list(range(10, 19)), max_tokens=8))
    _steps(s, runner, 2)
    pool = s.kv.pool
    victim = s.kv.tables["a"].ids[1]
    pool.free_blocks([pool.blocks[victim]])  # the bug: freed under a live table
    assert pool.blocks[victim].ref_cnt == 0
    events = s.verify_block_tables()
    assert [(e.kind, e.req_id, e.block_id, e.position) for e in events] == [
        ("stale_ref", "a", victim, 4)
    ]
    assert s.kv.tables["a"].ids == s.kv.tables["a"].ids[:1]
    assert s.requests["a"].num_computed_tokens == 4
    assert pool.blocks[victim].ref_cnt == 0  # not decremented twice
    assert s.check_invariants() == []
    _drain(s, runner)
    assert s.stats().used_blocks == 0


def test_an_altered_table_entry_is_a_table_mismatch() -> None:
    s = _sched()
    runner = FakeModelRunner(4)
    s.add_request(_req("a", list(range(10, 19))))
    s.add_request(_req("b", list(range(50, 59))))
    _steps(s, runner, 2)
    entry = s.kv.tables["a"]
    entry.ids = [entry.ids[0], s.kv.tables["b"].ids[0], *entry.ids[2:]]
    (event,) = s.verify_block_tables()
    assert (event.kind, event.req_id, event.position) == ("table_mismatch", "a", 4)
    assert s.check_invariants() == []


def test_a_block_failing_repeatedly_is_retired() -> None:
    s = _sched()
    pool = s.kv.pool
    for i in range(MAX_BLOCK_FAILURES):
        pool.quarantine(5)
        if i < MAX_BLOCK_FAILURES - 1:
            assert s.quarantined_block_ids() == [5]
            pool.release_quarantine(5)
    assert 5 in pool.retired and s.quarantined_block_ids() == []
    with pytest.raises(BlockStateError, match="retired"):
        pool.release_quarantine(5)
    assert s.stats().retired_blocks == 1
    assert s.check_invariants() == []


def test_a_request_that_no_longer_fits_fails_instead_of_waiting_forever() -> None:
    s = _sched(num_blocks=5)  # 4 usable blocks of 4 tokens
    runner = FakeModelRunner(4)
    s.add_request(_req("a", list(range(10, 19)), max_tokens=8))  # needs 4 blocks
    _steps(s, runner, 2)
    spare = next(iter(s.kv.pool.free_queue), None)
    bad = s.kv.tables["a"].ids[0]
    for _ in range(MAX_BLOCK_FAILURES - 1):
        s.kv.pool.quarantine(bad)
    report = s.recover([KVFault("checksum", (bad,), {}, "read")])
    assert report.failed == ("a",) and report.unrecoverable
    assert "a" not in s.requests and not s.has_unfinished_requests()
    assert spare is None or spare.state is not BlockState.USED
    assert s.check_invariants() == []


def test_mutations_from_a_foreign_thread_are_refused_and_counted() -> None:
    s = _sched()
    s.claim_ownership()
    s.add_request(_req("a", [1, 2, 3]))
    errors: list[Exception] = []

    def foreign() -> None:
        for call in (
            s.schedule,
            lambda: s.add_request(_req("b", [4])),
            lambda: s.kv.pool.free_blocks([s.kv.pool.blocks[1]]),
        ):
            try:
                call()
            except KVOwnershipError as exc:
                errors.append(exc)

    t = threading.Thread(target=foreign)
    t.start()
    t.join()
    assert len(errors) == 3
    assert s.stats().ownership_violations == 3
    assert "b" not in s.requests and s.check_invariants() == []
    _drain(s, FakeModelRunner(4))  # the owner carries on unharmed
