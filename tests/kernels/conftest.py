"""Kernel tests run through Triton's interpreter on CPU tensors (no GPU needed).

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before any
test module imports ``pagewarden.kernels``; on a machine with a GPU (``bench/gpu_check.sh``)
``PAGEWARDEN_KERNEL_DEVICE=cuda`` runs the same tests compiled, on the device.
"""

from __future__ import annotations

import os
import sys

import pytest

DEVICE = os.environ.get("PAGEWARDEN_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

if sys.platform != "linux":  # Triton ships Linux wheels only; there the test extra has it
    pytest.importorskip("triton", reason="Triton has no wheel for this platform")


@pytest.fixture
def device() -> str:
    return DEVICE
