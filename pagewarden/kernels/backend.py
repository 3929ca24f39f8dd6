"""Which attention backend runs, and whether it can run here.

``torch``: the plain-torch path of ``kernels/attention.py`` (any device).
``triton``: the kernels of this package. On CUDA they are compiled; on CPU they run only
through Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported),
which is for tests: it is orders of magnitude slower than the torch path.
``cpu``: the C++ kernels of ``kernels/cpu/attention_*.cpp`` on CPU caches
(``kernels/cpu/attention.py``), compiled on first use; it needs a C++ compiler and the ninja build tool. The default on
the CPU where both are found (``PAGEWARDEN_NO_CPU_EXT=1`` keeps the torch path).
"""

from __future__ import annotations

import importlib.util
import os
import shutil

from pagewarden.kernels.attention import AttentionBackendError

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackendError",
    "check_backend",
    "cpu_toolchain_found",
    "default_backend",
]

ATTENTION_BACKENDS: tuple[str, ...] = ("torch", "triton", "cpu")


def default_backend(device_type: str) -> str:
    """``triton`` on CUDA (where Triton is installed, as it is with torch's CUDA wheels);
    ``cpu`` on the CPU where a C++ compiler and ninja are found (the build itself happens
    in the engine, which keeps the torch path if it fails); ``torch`` elsewhere."""
    if device_type == "cuda":
        return "triton" if importlib.util.find_spec("triton") is not None else "torch"
    if device_type == "cpu" and cpu_toolchain_found():
        return "cpu"
    return "torch"


def cpu_toolchain_found() -> bool:
    """A C++ compiler and ninja are on PATH, and ``PAGEWARDEN_NO_CPU_EXT`` is not set (a
    cheap check: nothing is built here)."""
    if os.environ.get("PAGEWARDEN_NO_CPU_EXT", "").strip().lower() in ("1", "true", "yes"):
        return False
    compiler = os.environ.get("CXX", "c++")
    return shutil.which(compiler) is not None and shutil.which("ninja") is not None


def check_backend(name: str, device_type: str) -> None:
    """Raise ``AttentionBackendError`` unless backend ``name`` can run on ``device_type``."""
    if name not in ATTENTION_BACKENDS:
        raise AttentionBackendError(
            f"attention backend {name!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if name == "cpu":
        _check_cpu(device_type)
    if name != "triton":
        return
    if importlib.util.find_spec("triton") is None:
        raise AttentionBackendError(
            "attention backend 'triton' needs the triton package: pip install 'triton==3.7.1' "
            "(the version torch 2.13's CUDA wheel pins), or use --attention-backend torch"
        )
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise AttentionBackendError(
            "attention backend 'triton' on CPU runs only in Triton's interpreter: set "
            "TRITON_INTERPRET=1 before starting (slow, for tests), or use --attention-backend "
            "torch on CPU"
        )
    if device_type not in ("cpu", "cuda"):
        raise AttentionBackendError(
            f"attention backend 'triton' runs on cuda (or cpu under TRITON_INTERPRET=1), "
            f"not {device_type}"
        )


def _check_cpu(device_type: str) -> None:
    if device_type != "cpu":
        raise AttentionBackendError(
            f"attention backend 'cpu' reads caches in host memory, not on {device_type}; "
            "use --attention-backend triton or torch there"
        )
    from pagewarden.kernels.cpu import (
        attention as cpu_attention,  # builds the extension on first use
    )

    reason = cpu_attention.unavailable_reason()
    if reason is not None:
        raise AttentionBackendError(
            f"attention backend 'cpu' could not build its C++ extension ({reason}); "
            "install g++ and ninja, or use --attention-backend torch"
        )
