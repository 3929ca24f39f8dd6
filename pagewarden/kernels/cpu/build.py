"""How the C++ extensions built at first use (``cpu_fused``, ``cpu_gemm``,
``kernels/cpu/attention``, ``cpu_pool``) are compiled (``compile_extension``) and where they
live. Every one may include ``pool.h`` (the item pool's interface).

One directory per (extension, source, flags, torch version), under
``$PAGEWARDEN_EXTENSIONS_DIR`` or ``~/.cache/pagewarden``: a changed source never reuses
a stale build, and two checkouts of the same source (or two processes starting at once,
such as Ray replicas) share one build instead of rebuilding over each other. The
directories are created 0700 and refused when another user owns them or may write them
(``private_dir.py``): a planted build would be loaded as code.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from pagewarden.private_dir import ensure_private_dir

_POOL_HEADER = Path(__file__).with_name("pool.h")


def compile_extension(name: str, source: Path, cflags: list[str]) -> ModuleType:
    """Build (or load the cached build of) the OpenMP extension ``pagewarden_<name>``
    from ``source`` with ``cflags``; raises whatever the compiler or loader raises."""
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=f"pagewarden_{name}",
        sources=[str(source)],
        build_directory=str(build_directory(name, source, cflags)),
        extra_cflags=cflags,
        extra_include_paths=[str(_POOL_HEADER.parent)],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def build_directory(name: str, source: Path, flags: list[str]) -> Path:
    """The build directory of extension ``name`` compiled from ``source`` with ``flags``."""
    digest = hashlib.sha256(source.read_bytes() + _POOL_HEADER.read_bytes())
    digest.update(" ".join([*flags, torch.__version__]).encode())
    root = os.environ.get("PAGEWARDEN_EXTENSIONS_DIR") or Path.home() / ".cache/pagewarden"
    # Code the process will load: the directories are this user's and no one else's.
    ensure_private_dir(root)
    return ensure_private_dir(Path(root) / f"{name}_{digest.hexdigest()[:12]}")


def built_once(
    load: Callable[[], ModuleType | None],
) -> Callable[[], ModuleType | None]:
    """``load`` (which builds an extension, or returns None where it cannot) run on the
    first call only, under a lock; every later call returns that first result."""
    lock = threading.Lock()
    result: list[ModuleType | None] = []

    @functools.wraps(load)
    def once() -> ModuleType | None:
        if not result:
            with lock:
                if not result:
                    result.append(load())
        return result[0]

    return once
