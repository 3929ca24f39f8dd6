"""Flight records of a scheduler driven by the fake runner, with metadata faults and
recoveries, replayed: no divergence; an altered record diverges at the altered step."""

from __future__ import annotations

import json
import os
import random

import pytest

from pagewarden.engine.flight_recorder import FlightRecorder
from pagewarden.faults.metadata_faults import METADATA_FAULTS, inject_metadata_fault
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched import Request, Scheduler, SchedulerConfig
from pagewarden.sched.fake_runner import FakeModelRunner
from pagewarden.sched.output import KVFault
from pagewarden.sched.replay import FlightRecordError, load_record, replay

ZERO_COUNTS = (0,) * 8


def _campaign(tmp_path, window: int, seed: int = 0):
    """A mixed workload (shared prefixes, forks, swap and recompute preemption) with a
    metadata fault or a worker-style fault every few steps; returns the recorder."""
    cfg = SchedulerConfig(
        num_blocks=48,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        preemption_mode="swap",
        num_host_blocks=12,
    )
    sched = Scheduler(cfg)
    runner = FakeModelRunner(4, 1000)
    rec = FlightRecorder(sched, window, tmp_path, lambda: ZERO_COUNTS)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(9)] for _ in range(2)]
    for i in range(24):
        params = SamplingParams(
            max_tokens=rng.randrange(3, 24), ignore_eos=True, n=2 if i % 5 == 0 else 1
        )
        tail = [rng.randrange(1000) for _ in range(rng.randrange(1, 14))]
        sched.add_request(Request(str(i), prefixes[i % 2] + tail, params))
    kinds = ["use_after_free", "coherent_wrong_ref", "free_list_push", "checksum", "limits"]
    while sched.has_unfinished_requests():
        rec.begin_step()
        sched.verify_block_tables()
        out = sched.schedule()
        res = runner.execute(out)
        if sched.num_steps % 4 == 0:
            _fault(sched, rng, kinds[(sched.num_steps // 4) % len(kinds)], res)
        if res.faults:
            sched.recover(res.faults)
            gone = {r for f in res.faults for r in f.rollback}
            out = type(out)(out.step_id, [r for r in out.requests if r.req_id not in gone])
        sched.update(out, res)
        if sched.num_steps % 8 == 0 and sched.check_invariants():
            sched.repair()
        ready = sched.quarantined_block_ids()
        if ready:
            sched.release_quarantined(ready)
        rec.end_step()
        assert sched.num_steps < 500
    return rec


def _fault(sched: Scheduler, rng: random.Random, kind: str, res) -> None:
    running = [r for r in sched.running if r.req_id in sched.kv.tables]
    held = [(r.req_id, i, b) for r in running for i, b in enumerate(sched.kv.tables[r.req_id].ids)]
    if not held:
        return
    rid, index, block_id = rng.choice(held)
    if kind == "use_after_free" and sched.kv.pool.blocks[block_id].ref_cnt == 1:
        inject_metadata_fault(sched, kind, block_id)
    elif kind == "coherent_wrong_ref":
        others = [b for r, _, b in held if r != rid and b != block_id]
        if others:
            inject_metadata_fault(sched, kind, rid, index, rng.choice(others))
    elif kind == "free_list_push" and sched.kv.pool.blocks[block_id].prev_free is None:
        inject_metadata_fault(sched, kind, block_id)
    elif kind == "checksum":
        res.faults.append(KVFault("checksum", (block_id,), {rid: index * 4}, "read"))
    elif kind == "limits":
        sched.set_batch_limits(rng.randrange(2, 9), rng.randrange(16, 65))


@pytest.mark.parametrize("window", [6, 200])
def test_recorded_fault_campaign_replays_without_divergence(tmp_path, window):
    rec = _campaign(tmp_path, window)
    record = load_record(rec.dump("test"))
    # The window: a checkpoint, then between N and 2N step entries (all of them when
    # the run is shorter than the window).
    assert window <= len(record.steps) <= 2 * window or record.steps[0]["step"] == 0
    ops = {op["op"] for e in record.steps for op in e["ops"]}
    if record.steps[0]["step"] == 0:  # the whole run: every kind of call is in it
        assert {"add", "schedule", "update", "recover", "external", "limits", "verify"} <= ops
    assert any(e["allocated"] for e in record.steps) and any(e["freed"] for e in record.steps)
    result = replay(record, METADATA_FAULTS)
    assert result.divergence is None, result.divergence
    assert result.num_steps == len(record.steps)


def _rewrite(path, fn) -> None:
    lines = [json.loads(line) for line in open(path)]
    fn(lines)
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


def _entry(lines, step: int) -> dict:
    return next(line for line in lines if line.get("type") == "step" and line["step"] == step)


def test_altered_block_table_is_reported_at_its_step(tmp_path):
    path = _campaign(tmp_path, 6).dump("test")
    record = load_record(path)
    target = record.steps[len(record.steps) // 2]["step"]

    def alter(lines):
        sched = next(op for op in _entry(lines, target)["ops"] if op["op"] == "schedule")
        sched["requests"][0][4][-1] += 1  # the epoch of the first request's last block

    _rewrite(path, alter)
    d = replay(load_record(path), METADATA_FAULTS).divergence
    assert d is not None and d.step == target
    assert "block_table epochs" in d.field and d.expected != d.got


def test_altered_allocation_is_reported_at_its_step(tmp_path):
    path = _campaign(tmp_path, 200).dump("test")
    steps = [e["step"] for e in load_record(path).steps if e["allocated"]]
    target = steps[len(steps) // 2]

    def alter(lines):
        _entry(lines, target)["allocated"][0] += 1

    _rewrite(path, alter)
    d = replay(load_record(path), METADATA_FAULTS).divergence
    assert d is not None and (d.step, d.field) == (target, "allocated blocks")


def test_unjournaled_metadata_change_diverges(tmp_path):
    """A change nobody journaled (a real bug) shows up as a divergence."""
    path = _campaign(tmp_path, 200).dump("test")

    def drop(lines):
        for line in lines[2:]:
            line["ops"] = [op for op in line["ops"] if op["op"] != "external"]

    _rewrite(path, drop)
    assert replay(load_record(path), METADATA_FAULTS).divergence is not None


def test_foreign_format_and_version_are_refused(tmp_path):
    path = _campaign(tmp_path, 200).dump("test")
    _rewrite(path, lambda lines: lines[0].update(version=99))
    with pytest.raises(FlightRecordError, match="version 99"):
        load_record(path)
    other = tmp_path / "other.jsonl"
    other.write_text('{"hello": 1}\n')
    with pytest.raises(FlightRecordError, match="not a pagewarden flight record"):
        load_record(other)


def test_fault_triggers_are_coalesced_within_the_cooldown(tmp_path):
    counts = [0] * 8
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4))
    rec = FlightRecorder(sched, 8, tmp_path, lambda: tuple(counts))
    for step in range(1, 13):
        rec.begin_step()
        sched.schedule()
        if step in (2, 3, 5):
            counts[0] += 1
        rec.end_step()
    assert rec.close() is None  # nothing pending; waits for the background writes
    # Step 2 writes at once; steps 3 and 5 wait for the cooldown (4 steps), written at 6.
    reasons = sorted(json.loads(open(p).readline())["reason"] for p in rec.dumps)
    assert reasons == ["fault detected in step 2", "fault detected in steps 3, 5"]


def test_records_are_private_and_capped(tmp_path):
    rec = _campaign(tmp_path / "records", 6)
    rec.max_files = 3
    paths = [rec.dump(f"test {i}") for i in range(5)]
    kept = sorted(p.name for p in (tmp_path / "records").glob("flight-*.jsonl"))
    assert kept == sorted(p.name for p in paths[-3:])  # the oldest deleted first
    assert oct(os.stat(tmp_path / "records").st_mode & 0o777) == oct(0o700)
    assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in paths[-3:])
    rec.max_files, rec.max_bytes = 100, paths[-1].stat().st_size + 1
    rec.dump("over the byte cap")
    assert len(list((tmp_path / "records").glob("flight-*.jsonl"))) == 1


def test_recorder_refuses_a_world_writable_directory(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    rec = _campaign(shared, 6)
    assert rec.dump("test") is None and not list(shared.glob("flight-*"))


@pytest.mark.parametrize(
    "alter,message",
    [
        (lambda lines: lines[1]["state"]["config"].update(num_blocks=10**12), "num_blocks"),
        (lambda lines: lines[1]["state"]["kv"]["blocks"].pop(), "claims 48 blocks"),
        (lambda lines: lines[1]["state"].pop("requests"), "cannot be restored"),
        (lambda lines: lines.__setitem__(2, [1, 2]), "not a pagewarden flight record"),
    ],
)
def test_hostile_records_get_one_line_errors_fast(tmp_path, capsys, alter, message):
    from pagewarden.cli import main

    path = _campaign(tmp_path, 6).dump("test")
    _rewrite(path, alter)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_a_file_that_is_not_json_is_refused(tmp_path, capsys):
    from pagewarden.cli import main

    path = tmp_path / "junk.jsonl"
    path.write_bytes(b"\xff\xfe not json\n")
    assert main(["replay", str(path)]) == 2
    assert "not a pagewarden flight record" in capsys.readouterr().err
