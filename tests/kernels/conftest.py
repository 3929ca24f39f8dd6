"""Kernel tests run through Triton's interpreter on CPU tensors (no GPU needed).

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before any
test module imports ``pagewarden.kernels``; on a machine with a GPU (``bench/gpu_check.sh``)
``PAGEWARDEN_KERNEL_DEVICE=cuda`` runs the same tests compiled, on the device.
"""

from __future__ import annotations

import os

import pytest

DEVICE = os.environ.get("PAGEWARDEN_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="install the test extra: pip install -e '.[test]'")


@pytest.fixture
def device() -> str:
    return DEVICE
