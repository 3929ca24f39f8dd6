"""``pagewarden chaos`` on the tiny random Llama: the issue's targets, asserted."""

from __future__ import annotations

import pytest

from pagewarden.chaos.campaign import run_chaos
from pagewarden.cli import main
from pagewarden.faults.injector import FAULT_KINDS
from pagewarden.models.loader import load_model


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    import torch

    return load_model(tiny_llama_dir, torch.float32)


def test_strict_detects_everything_releases_nothing_and_outputs_match(tiny_llama_dir, loaded):
    report = run_chaos(
        str(tiny_llama_dir), num_faults=36, integrity="strict", num_requests=12, loaded=loaded
    )
    assert {r.kind for r in report.rows if r.injected} == set(FAULT_KINDS)
    assert report.injected >= 30
    assert report.detected == report.injected, report.table()
    assert all(r.recovered == r.injected for r in report.rows)
    assert report.corrupted_tokens == 0
    assert report.failed_requests == 0
    assert report.outputs_equal, report.table()
    assert report.preemptions > 0 and report.prefix_hit_tokens > 0
    assert report.swapped_out_blocks > 0
    assert report.invariant_violations == [] and report.crash is None
    # The pool is whole: every block free, cached-free, quarantined or retired.
    assert report.leaked_blocks == 0, report.table()
    assert "used" not in report.pool_states, report.table()
    assert "corrupted tokens released: 0" in report.table()


def test_standard_catches_sealed_faults_before_reuse_or_by_scrub(tiny_llama_dir, loaded):
    report = run_chaos(
        str(tiny_llama_dir),
        num_faults=21,
        integrity="standard",
        num_requests=12,
        seed=1,
        loaded=loaded,
    )
    rows = {r.kind: r for r in report.rows}
    sealed = rows["sealed_bitflip"]
    # Every sealed-block fault is found (by reuse, or the scrubber) unless the block was
    # rewritten first; the worst scrubber delay is reported.
    assert sealed.detected + sealed.harmless == sealed.injected
    # A corrupted host block is verified when it comes back, before anything reads it.
    for kind in (
        "tag_corruption",
        "table_redirect",
        "slot_redirect",
        "use_after_free",
        "foreign_thread",
        "swap_corruption",
    ):
        assert rows[kind].detected == rows[kind].injected, report.table()
    assert report.failed_requests == 0 and report.crash is None
    assert report.invariant_violations == []


def test_chaos_cli_prints_the_table(tiny_llama_dir, capsys):
    assert (
        main(
            [
                "chaos",
                "--model",
                str(tiny_llama_dir),
                "--faults",
                "7",
                "--requests",
                "6",
                "--max-tokens",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "fault kind" in out and "corrupted tokens released: 0" in out
    assert "outputs identical to the fault-free run: yes" in out
