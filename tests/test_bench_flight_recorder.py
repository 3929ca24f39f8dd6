"""bench/flight_recorder_cost.py runs on a tiny model and prints every figure."""

import os
import re
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def test_flight_recorder_cost_prints_its_figures(tiny_llama_dir, tmp_path):
    cmd = [sys.executable, str(_ROOT / "bench" / "flight_recorder_cost.py")]
    cmd += [f"--model={tiny_llama_dir}", "--dtype=float32", "--num-prompts=4", "--input-len=8"]
    cmd += ["--decode-steps=2", "--rounds=1", "--fake-steps=24", "--window=8", "--num-blocks=64"]
    env = dict(os.environ, PYTHONPATH=str(_ROOT), OMP_WAIT_POLICY="PASSIVE", TMPDIR=str(tmp_path))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=True)
    assert re.search(r"recorder cost +-?[\d.]+ us/step", out.stdout), out.stdout
    assert re.search(r"writing one record \(\d+ step entries, [\d.]+ MB\)", out.stdout)
    assert re.search(r"recorder cost / real step: -?[\d.]+%", out.stdout)
