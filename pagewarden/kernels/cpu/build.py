"""How the C++ extensions built at first use (``cpu_fused``, ``cpu_gemm``,
``kernels/cpu/attention``, ``cpu_pool``) are compiled (``compile_extension``) and where they
live. Every one may include ``pool.h`` (the item pool's interface) and the headers beside
it (``attention_common.h``).

One directory per (extension, source, flags, torch version), under
``$PAGEWARDEN_EXTENSIONS_DIR`` or ``~/.cache/pagewarden``: a changed source never reuses
a stale build, and two checkouts of the same source (or two processes starting at once,
such as Ray replicas) share one build instead of rebuilding over each other. The
directories are created 0700 and refused when another user owns them or may write them
(``private_dir.py``): a planted build would be loaded as code.

Compile time: ``torch/extension.h`` (pybind11 and all of ATen) costs about 30 s of every
translation unit that includes it on a 2-core Zen 4, the kernel code itself a few
seconds. Only the file that defines an extension's Python module includes it (through
``pool_bind.h`` where the module binds the item pool); the kernel files include
``pool.h``, ``<ATen/core/Tensor.h>``, ``<ATen/Parallel.h>``, ``<c10/util/Exception.h>``
or single ``<ATen/ops/...>`` headers. ``warm.build_all`` builds the extensions on a
thread per core (about two minutes for all of them there, from nothing).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from pagewarden.private_dir import ensure_private_dir

_POOL_HEADER = Path(__file__).with_name("pool.h")
#: torch's build lock (``build_directory/lock``) older than this is taken for one left by
#: a process killed mid-build, and removed: torch waits on it for ever otherwise. A
#: build takes a minute or two, several on a loaded machine.
STALE_LOCK_S = 15 * 60

logger = logging.getLogger("pagewarden.kernels")


def compile_extension(name: str, source: Path | list[Path], cflags: list[str]) -> ModuleType:
    """Build (or load the cached build of) the OpenMP extension ``pagewarden_<name>``
    from ``source`` (one file or several) with ``cflags``; raises whatever the compiler or
    loader raises."""
    from torch.utils import cpp_extension

    sources = source if isinstance(source, list) else [source]
    directory = build_directory(name, sources, cflags)
    remove_stale_lock(directory)
    return cpp_extension.load(
        name=f"pagewarden_{name}",
        sources=[str(s) for s in sources],
        build_directory=str(directory),
        extra_cflags=cflags,
        extra_include_paths=[str(_POOL_HEADER.parent)],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def remove_stale_lock(directory: Path, now: float | None = None) -> bool:
    """Remove ``directory/lock`` when it is older than ``STALE_LOCK_S`` (True if removed)."""
    lock = directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    logger.warning(
        "pagewarden: removing a build lock left %.0f min ago by a process that did not "
        "finish (%s); building again",
        age / 60,
        lock,
    )
    lock.unlink(missing_ok=True)
    return True


def build_directory(name: str, source: Path | list[Path], flags: list[str]) -> Path:
    """The build directory of extension ``name`` compiled from ``source`` with ``flags``
    (keyed by the sources, ``pool.h`` and the headers beside it that they include)."""
    sources = source if isinstance(source, list) else [source]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [*sources, *_headers(sources)]))
    digest.update(" ".join([*flags, torch.__version__]).encode())
    root = os.environ.get("PAGEWARDEN_EXTENSIONS_DIR") or Path.home() / ".cache/pagewarden"
    # Code the process will load: the directories are this user's and no one else's.
    ensure_private_dir(root)
    return ensure_private_dir(Path(root) / f"{name}_{digest.hexdigest()[:12]}")


def _headers(sources: list[Path]) -> list[Path]:
    """``pool.h``, then the headers of this directory the sources include by name."""
    names = {n for s in sources for n in re.findall(r'#include "([^"]+)"', s.read_text())}
    return [_POOL_HEADER, *sorted(_POOL_HEADER.parent / n for n in names if n != "pool.h")]


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
