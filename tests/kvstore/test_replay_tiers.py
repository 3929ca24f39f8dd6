"""A flight record of an engine that loaded blocks from a KV tier replays without
divergence: the record holds the tiers' answers and replay gives them back."""

from __future__ import annotations

import json

from pagewarden.sched.replay import FlightRecord, load_record, replay
from tests.kvstore.test_disk_engine import PROMPTS, _llm, _run


def _record(tiny_llama_dir, tmp_path) -> FlightRecord:
    llm = _llm(
        tiny_llama_dir,
        tmp_path / "tier",
        flight_recorder_dir=str(tmp_path / "records"),
        flight_recorder_steps=4096,
    )
    _run(llm, PROMPTS + PROMPTS[:1])  # the last prompt's prefix comes back from the tier
    assert llm.engine.kv_tiers.counters.hits["disk"] >= 9
    return load_record(llm.engine.recorder.dump("test"))


def _tier_ops(record: FlightRecord) -> list[dict]:
    return [op for s in record.steps for op in s["ops"] if op["op"] == "tier"]


def test_a_record_with_tier_loads_replays_without_divergence(tiny_llama_dir, tmp_path):
    record = _record(tiny_llama_dir, tmp_path)
    extends = [op["args"] for op in _tier_ops(record) if op["call"] == "extend"]
    assert any(n for _, n in extends)  # a load placed blocks
    assert any(n is None for _, n in extends)  # a request waited for its load
    result = replay(record)
    assert result.divergence is None, str(result.divergence)


def test_a_changed_tier_answer_is_a_divergence(tiny_llama_dir, tmp_path):
    record = _record(tiny_llama_dir, tmp_path)
    op = next(op for op in _tier_ops(record) if op["call"] == "extend" and op["args"][1])
    op["args"][1] -= 1  # one block fewer loaded than the engine placed
    steps = json.loads(json.dumps(record.steps))
    result = replay(FlightRecord(record.header, record.checkpoint, steps))
    assert result.divergence is not None


def test_without_the_tier_answers_replay_diverges_where_blocks_were_loaded(
    tiny_llama_dir, tmp_path
):
    record = _record(tiny_llama_dir, tmp_path)
    steps = [dict(s, ops=[op for op in s["ops"] if op["op"] != "tier"]) for s in record.steps]
    result = replay(FlightRecord(record.header, record.checkpoint, steps))
    assert result.divergence is not None
    assert "first position" in result.divergence.field  # recomputed, not loaded
