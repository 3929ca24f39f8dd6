"""bench/control_plane.py runs to completion and leaves the collector as it found it."""

import gc
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "control_plane.py"


@pytest.fixture(scope="module")
def control_plane():
    spec = importlib.util.spec_from_file_location("control_plane_bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tuned_gc", [True, False])
def test_run_completes_and_restores_gc(control_plane, tuned_gc):
    before = gc.get_threshold()
    rps, block_ops, median_schedule = control_plane.run(300, 8, tuned_gc)
    assert rps > 0 and block_ops > 0 and median_schedule > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_prompts_share_a_prefix(control_plane):
    import random

    prompts = control_plane._prompts(3, random.Random(0))
    assert all(len(p) == 64 for p in prompts)
    assert prompts[0][:16] == prompts[1][:16] == prompts[2][:16]
    assert prompts[0][16:] != prompts[1][16:]
