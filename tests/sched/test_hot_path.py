"""The scheduler's hot-path helpers: cheap dataclass construction, slot runs, shared tables."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pagewarden.sampling_params import SamplingParams
from pagewarden.sched import Request, Scheduler, SchedulerConfig
from pagewarden.sched.fake_runner import FakeModelRunner
from pagewarden.sched.fast_dataclass import fast_constructor
from pagewarden.sched.output import ScheduledRequest, SchedulerOutput, SlotRun
from pagewarden.sched.output import slot_mapping_for as _slot_mapping
from pagewarden.sched.scheduler import RequestUpdate


def test_fast_constructor_builds_equal_frozen_instances() -> None:
    params = SamplingParams()
    args = ("a", [1, 2], range(3, 5), [7], [29, 30], True, params, [1], [2], 5)
    fast = fast_constructor(ScheduledRequest)(*args)
    assert type(fast) is ScheduledRequest and fast == ScheduledRequest(*args)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.req_id = "b"  # type: ignore[misc]
    # Defaults and default factories behave as in the dataclass's own __init__.
    assert fast_constructor(ScheduledRequest)(*args[:-1]).seed is None
    u1 = fast_constructor(RequestUpdate)("a", None, 0, [1], False, None, None, 3, 0)
    u2 = fast_constructor(RequestUpdate)("a", None, 0, [1], False, None, None, 3, 0)
    assert u1 == RequestUpdate("a", None, 0, [1], False, None, None, 3, 0)
    assert u1.logprobs == [] and u1.logprobs is not u2.logprobs
    out = fast_constructor(SchedulerOutput)(1, [])
    assert (
        out == SchedulerOutput(1, []) and out.copy_blocks is not SchedulerOutput(1, []).copy_blocks
    )


def test_fast_constructor_falls_back_where_the_trick_does_not_apply() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        x: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class PostInit:
        x: int

        def __post_init__(self) -> None:
            assert self.x >= 0

    assert fast_constructor(NoSlots) is NoSlots
    assert fast_constructor(PostInit) is PostInit


def test_slot_mapping_matches_the_per_position_formula() -> None:
    rng = random.Random(0)
    for _ in range(300):
        bs = rng.randint(1, 8)
        ids = [rng.randrange(1, 100) for _ in range(6)]
        start = rng.randrange(0, 6 * bs)
        end = rng.randint(start, 6 * bs)
        expected = [ids[p // bs] * bs + p % bs for p in range(start, end)]
        assert _slot_mapping(ids, bs, start, end) == expected
    assert _slot_mapping([7, 3], 4, 2, 7) == [30, 31, 12, 13, 14]


def test_block_tables_handed_out_are_never_mutated_afterwards() -> None:
    """Block tables are shared with the runner without a copy: the scheduler must replace
    them, never change them in place (allocation, copy on write, preemption, finish)."""
    rng = random.Random(7)
    cfg = SchedulerConfig(
        num_blocks=12, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=64
    )
    s = Scheduler(cfg)
    runner = FakeModelRunner(cfg.block_size, verify=True)
    shared = [rng.randrange(50) for _ in range(9)]
    for i in range(40):
        prompt = shared[: rng.randint(0, 9)] + [
            rng.randrange(50) for _ in range(rng.randint(1, 10))
        ]
        n = rng.choice([1, 1, 2, 3])
        s.add_request(
            Request(
                f"r{i}", prompt, SamplingParams(n=n, max_tokens=rng.randint(1, 12), ignore_eos=True)
            )
        )
    seen: list[tuple[list[int], list[int]]] = []
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        seen += [(sr.block_table, list(sr.block_table)) for sr in out.all_requests()]
        s.update(out, runner.execute(out))
        steps += 1
        assert steps < 10_000
    assert s.num_preemptions > 0 and seen
    for table, snapshot in seen:
        assert table == snapshot
    assert s.check_invariants() == []


def test_decode_batch_is_the_same_step_as_scheduled_requests() -> None:
    """A scheduler fed its own columnar outputs and one fed the materialized ones (every
    decode as a ScheduledRequest) make the same steps and the same tokens."""
    rng = random.Random(11)
    cfg = SchedulerConfig(
        num_blocks=14, block_size=4, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64
    )
    columnar, objects = Scheduler(cfg), Scheduler(cfg)
    runner_a = FakeModelRunner(cfg.block_size, verify=True)
    runner_b = FakeModelRunner(cfg.block_size, verify=True)
    for i in range(30):
        prompt = [rng.randrange(40) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(
            n=rng.choice([1, 1, 2]), max_tokens=rng.randint(1, 10), ignore_eos=True
        )
        columnar.add_request(Request(f"r{i}", prompt, params))
        objects.add_request(Request(f"r{i}", prompt, params))
    decodes = 0
    while columnar.has_unfinished_requests():
        out_a = columnar.schedule()
        out_b = objects.schedule().materialized()
        assert not out_b.decodes and out_b.all_requests() == out_a.all_requests()
        assert out_a.num_batched_tokens == out_b.num_batched_tokens
        decodes += len(out_a.decodes)
        for i, rid in enumerate(out_a.decodes.req_ids):
            sr = out_a.all_requests()[i]
            assert (sr.req_id, sr.positions.stop, sr.sample) == (
                rid,
                out_a.decodes.positions[i] + 1,
                True,
            )
        ups_a = columnar.update(out_a, runner_a.execute(out_a))
        ups_b = objects.update(out_b, runner_b.execute(out_b))
        assert list(ups_a) == list(ups_b)
        assert ups_a.req_ids == [u.req_id for u in ups_b]
        assert ups_a.token_ids == [u.new_token_ids[0] for u in ups_b]
        assert set(ups_a.finished) == {u.req_id for u in ups_a if u.finished}
    assert not objects.has_unfinished_requests() and decodes > 50
    assert columnar.check_invariants() == [] and objects.check_invariants() == []


def test_update_skips_decodes_of_requests_gone_since_scheduling() -> None:
    cfg = SchedulerConfig(
        num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32
    )
    s = Scheduler(cfg)
    runner = FakeModelRunner(cfg.block_size)
    for rid in ("a", "b", "c"):
        s.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)))
    out = s.schedule()
    s.update(out, runner.execute(out))
    out = s.schedule()
    assert out.decodes.req_ids == ["a", "b", "c"] and out.decodes.slot_mapping == [7, 11, 15]
    res = runner.execute(out)
    s.abort_requests(["b"])  # not what the engine does, but update must cope
    ups = s.update(out, res)
    assert ups.req_ids == ["a", "c"] and ups.token_ids == res.decode_token_ids[::2]
    assert [u.req_id for u in ups] == ["a", "c"] and not ups.finished
    assert s.requests["a"].output_token_ids == [runner.token_for("a", 3), runner.token_for("a", 4)]
    assert s.check_invariants() == []


def test_only_fork_children_share_a_partly_filled_block() -> None:
    """The decode fast path skips the copy-on-write check for requests that are not fork
    children; check_invariants guards the assumption that makes that safe."""
    cfg = SchedulerConfig(
        num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32
    )
    s = Scheduler(cfg)
    runner = FakeModelRunner(cfg.block_size, verify=True)
    s.add_request(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True)))
    s.add_request(
        Request("p", [1, 2, 3, 4, 5, 6], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    )
    for _ in range(2):
        out = s.schedule()
        s.update(out, runner.execute(out))
        assert s.check_invariants() == []
    a_block = s.kv.tables["a"].ids[-1]
    s.kv.pool.blocks[a_block].ref_cnt += 1  # as if something shared a's open block
    assert any("partly filled block" in e for e in s.check_invariants())
    s.kv.pool.blocks[a_block].ref_cnt -= 1
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update(out, runner.execute(out))
        assert s.check_invariants() == []


def test_slot_run_is_a_lazy_read_only_slot_list() -> None:
    run = SlotRun([7, 3], 4, 2, 7)
    assert len(run) == 5 and run._slots is None  # length needs no list
    assert run == [30, 31, 12, 13, 14] and [30, 31, 12, 13, 14] == run
    assert list(run) == [30, 31, 12, 13, 14] and run[1] == 31 and run[-1] == 14
    assert run == SlotRun([7, 3], 4, 2, 7) and run != [30, 31] and run != "x"
    assert len(SlotRun([7], 4, 2, 2)) == 0 and list(SlotRun([7], 4, 2, 2)) == []
    # What the scheduler hands out for a chunk: the same slots as the formula.
    cfg = SchedulerConfig(
        num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32
    )
    s = Scheduler(cfg)
    s.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=2)))
    (sr,) = s.schedule().all_requests()
    assert isinstance(sr.slot_mapping, SlotRun)
    assert sr.slot_mapping == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]


def test_step_updates_read_after_an_abort_is_a_clear_error() -> None:
    cfg = SchedulerConfig(
        num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32
    )
    s = Scheduler(cfg)
    runner = FakeModelRunner(cfg.block_size)
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    out = s.schedule()
    ups = s.update(out, runner.execute(out))
    s.abort_requests(["a"])
    with pytest.raises(RuntimeError, match="before this step's updates were read"):
        list(ups)
    out = s.schedule()
    assert out.is_empty and s.check_invariants() == []
