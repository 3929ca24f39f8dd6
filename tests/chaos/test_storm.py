"""``pagewarden chaos --scenario storm`` on the tiny model: the batch limit falls and
recovers, the profile goes to safe and back, every fault is recovered, outputs equal the
fault-free run, and the plot is written."""

from __future__ import annotations

import sys

import torch

from pagewarden.chaos.storm import run_storm, storm_config
from pagewarden.chaos.storm_plot import write_storm_plot
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


def _storm_cli(tiny_llama_dir, tmp_path, *extra: str) -> int:
    from pagewarden.cli import main

    return main(
        [
            "chaos",
            "--scenario",
            "storm",
            "--model",
            str(tiny_llama_dir),
            "--faults",
            "4",
            "--burst-seconds",
            "0.5",
            "--max-num-seqs",
            "4",
            "--clean-period",
            "0.5",
            "--max-tokens",
            "8",
            "--flight-recorder-dir",
            str(tmp_path / "fr"),
            *extra,
        ]
    )


def test_storm_without_matplotlib_prints_the_report_and_a_note(
    tiny_llama_dir, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    monkeypatch.chdir(tmp_path)
    status = _storm_cli(tiny_llama_dir, tmp_path)
    out = capsys.readouterr().out
    assert status in (0, 1)  # the scenario's own verdict, not a crash
    assert "faults:" in out and "outputs identical to the fault-free run" in out
    notes = [line for line in out.splitlines() if "pagewarden[chaos]" in line]
    assert notes == [
        "plot skipped: the storm plot needs matplotlib (pip install 'pagewarden[chaos]')"
    ]
    assert not (tmp_path / "pagewarden-storm.png").exists()


def test_storm_without_matplotlib_fails_when_the_plot_was_asked_for(
    tiny_llama_dir, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "asked.png"
    status = _storm_cli(tiny_llama_dir, tmp_path, "--plot", str(png))
    captured = capsys.readouterr()
    assert status == 2
    assert "outputs identical to the fault-free run" in captured.out  # the report came first
    assert "needs matplotlib" in captured.err and "pagewarden[chaos]" in captured.err
    assert not png.exists()
