"""bench/profile_step.py runs on a tiny model and accounts for the whole step."""

import os
import re
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
PHASES = ("attention", "kv write", "GEMMs", "lm_head", "elementwise", "sampler", "integrity")


def test_profile_step_prints_every_phase(tiny_llama_dir):
    cmd = [sys.executable, str(_ROOT / "bench" / "profile_step.py"), f"--model={tiny_llama_dir}"]
    cmd += ["--dtype=float32", "--num-prompts=3", "--input-len=8", "--decode-steps=2"]
    env = dict(os.environ, PYTHONPATH=str(_ROOT), OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=True)
    sections = re.split(r"^(?=prefill step|decode step)", out.stdout, flags=re.M)[1:]
    assert [s.split()[0] for s in sections] == ["prefill", "decode"]
    for section in sections:
        total = float(re.search(r"([\d.]+) ms per step", section).group(1))
        shares = dict(re.findall(r"^  (\S+(?: \S+)?)\s+(-?[\d.]+) ms", section, flags=re.M))
        assert set(PHASES) | {"bookkeeping"} == set(shares)
        assert float(shares["GEMMs"]) > 0 and float(shares["attention"]) > 0
        # The phases partition the step (bookkeeping is the remainder).
        assert abs(sum(float(v) for v in shares.values()) - total) < 0.05 * total + 0.1
