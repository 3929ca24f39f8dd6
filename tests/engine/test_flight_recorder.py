"""The flight recorder on a tiny engine: a chaos campaign writes records that replay
without divergence; an altered record and a crash are handled as an operator needs."""

from __future__ import annotations

import json

import pytest
import torch

from pagewarden.chaos.campaign import run_chaos
from pagewarden.cli import main
from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core import EngineCore
from pagewarden.faults.metadata_faults import METADATA_FAULTS
from pagewarden.models.loader import load_model
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.replay import load_record, replay
from pagewarden.worker.step_hooks import StepHooks


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir, torch.float32)


@pytest.fixture(scope="module")
def campaign(tiny_llama_dir, loaded, tmp_path_factory):
    """Every fault kind, with a window short enough that records start mid-run."""
    out = tmp_path_factory.mktemp("records")
    report = run_chaos(
        str(tiny_llama_dir),
        num_faults=24,
        integrity="strict",
        num_requests=10,
        loaded=loaded,
        flight_recorder_steps=12,
        flight_recorder_dir=str(out),
    )
    return report


def test_chaos_campaign_records_replay_without_divergence(campaign):
    assert campaign.detected == campaign.injected and campaign.outputs_equal
    assert len(campaign.flight_records) >= 2
    starts = set()
    for path in campaign.flight_records:
        record = load_record(path)
        assert record.header["reason"].startswith("fault detected in step")
        starts.add(record.steps[0]["step"])
        entry = next(e for e in record.steps if e["duration_ms"] is not None)
        assert entry["limits"] and entry["integrity"]["tag_checks"] >= 0
        result = replay(record, METADATA_FAULTS)
        assert result.divergence is None, (path, result.divergence)
    assert max(starts) > 0  # some record starts from a mid-run checkpoint


def test_replay_cli_reports_the_altered_step(campaign, tmp_path, capsys):
    source = campaign.flight_records[-1]
    assert main(["replay", source]) == 0
    assert "no divergence" in capsys.readouterr().out
    lines = [json.loads(line) for line in open(source)]
    entries = [e for e in lines[2:] if any(op["op"] == "schedule" for op in e["ops"])]
    target = entries[len(entries) // 2]
    op = next(op for op in target["ops"] if op["op"] == "schedule")
    op["requests"][0][1] += 1  # the first scheduled request's first position
    altered = tmp_path / "altered.jsonl"
    altered.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["replay", str(altered)]) == 1
    out = capsys.readouterr().out
    assert f"DIVERGENCE at step {target['step']}" in out and "first position" in out


class _Crash(StepHooks):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def before_execute(self, out):
        if out.step_id == self.at_step:
            raise RuntimeError("worker crashed")
        return out


def test_crash_record_replays_up_to_the_crash(tiny_llama_dir, loaded, tmp_path):
    config = EngineConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        block_size=8,
        num_kv_blocks=24,
        flight_recorder_dir=str(tmp_path),
    )
    engine = EngineCore(config, loaded)
    for i in range(4):
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        engine.add_request(str(i), [5 + i, 6, 7, 8, 9, 10, 11], params)
    engine.install_hooks(_Crash(at_step=6))
    with pytest.raises(RuntimeError, match="worker crashed"):
        while engine.has_unfinished():
            engine.step()
    path = engine.recorder.dump("engine crash: worker crashed")
    record = load_record(path)
    assert record.steps[-1]["step"] == 6 and record.steps[-1]["duration_ms"] is None
    assert replay(record, METADATA_FAULTS).divergence is None


def test_recorder_off_and_flags(tiny_llama_dir, loaded):
    engine = EngineCore(
        EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=8, flight_recorder_steps=0),
        loaded,
    )
    assert engine.recorder is None and engine.scheduler.journal is None
    with pytest.raises(ValueError, match="flight_recorder_steps"):
        EngineConfig(flight_recorder_steps=-1)
