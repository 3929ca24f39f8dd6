"""``import pagewarden`` makes idle OpenMP threads sleep unless the user chose otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "import pagewarden, os, torch; print(os.environ['OMP_WAIT_POLICY'])"


@pytest.mark.parametrize(
    "env,want",
    [
        ({}, "PASSIVE"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
        ({"PAGEWARDEN_OMP_ACTIVE": "1"}, "ACTIVE"),
    ],
)
def test_wait_policy(env, want):
    base = {
        k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "PAGEWARDEN_OMP_ACTIVE")
    }
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**base, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == want
