"""``pagewarden chaos --scenario storm`` on the tiny model: the batch limit falls and
recovers, the profile goes to safe and back, every fault is recovered, outputs equal the
fault-free run, and the plot is written."""

from __future__ import annotations

import torch

from pagewarden.faults.storm import run_storm, storm_config
from pagewarden.faults.storm_plot import write_storm_plot
from pagewarden.models.loader import load_model


def test_a_short_storm_on_the_tiny_model(tiny_llama_dir, tmp_path) -> None:
    loaded = load_model(str(tiny_llama_dir), torch.float32)
    config = storm_config(str(tiny_llama_dir), max_num_seqs=8, safe_mode_clean_period=0.8)
    report = run_storm(
        config, loaded, num_faults=8, warmup_s=0.3, burst_s=1.0, recorder_dir=tmp_path / "fr"
    )
    table = report.table()
    assert report.limit_fell and report.limit_recovered, table
    assert min(s.max_num_seqs for s in report.samples) == report.floor == 2
    assert report.went_safe and report.came_back, table
    assert report.switches[("normal", "safe", "fault_burst")] == 1
    assert report.switches[("safe", "normal", "clean_period")] == 1
    assert report.injected == 8 and report.all_recovered, table
    assert report.outputs_equal, table
    # While safe, the batch stays at the floor; after it, it climbs back step by step.
    profiles = [s.profile for s in report.samples]
    first, back = profiles.index("safe"), profiles.index("normal", profiles.index("safe"))
    assert {s.max_num_seqs for s in report.samples[first:back]} == {2}
    climb = [s.max_num_seqs for s in report.samples[back:]]
    assert climb == sorted(climb) and climb[-1] == 8
    if report.flight_recorder_files is None:
        assert "flight recorder: not in this build" in table
    else:
        assert report.flight_recorder_files, "the flight recorder wrote nothing"
    png = tmp_path / "storm.png"
    write_storm_plot(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 150_000
