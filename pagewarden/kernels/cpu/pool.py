"""The item pool of ``cpu_pool.cpp``: the threads the C++ kernels share.

``bind(ext)`` hands a kernel extension (cpu_gemm, cpu_fused, kernels/cpu_attention) the
pool's capsule; each extension's loader calls it, so all of them use the one pool of the
process. Where the pool cannot build, or with ``PAGEWARDEN_NO_CPU_POOL=1``, the kernels
keep OpenMP (``at::parallel_for``), which with ``OMP_WAIT_POLICY=PASSIVE`` wakes its
sleeping threads by futex at every parallel region.

``PAGEWARDEN_POOL_SPIN_US`` (default 100) is how long an idle worker polls for the next
task before it sleeps; it stops polling at once when another thread wants its core (see
the source). 0: always sleep, as PASSIVE OpenMP does. Measured: ``bench/profile_step.py``
and ``bench/omp_wait.py``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

from pagewarden.kernels.cpu.build import built_once, compile_extension

log = logging.getLogger(__name__)

#: Set to 1 to keep the kernels on OpenMP's threads.
DISABLE_ENV = "PAGEWARDEN_NO_CPU_POOL"
#: Microseconds an idle worker polls for the next task before it sleeps.
SPIN_ENV = "PAGEWARDEN_POOL_SPIN_US"
DEFAULT_SPIN_US = 100

_SOURCE = Path(__file__).with_name("pool.cpp")


@built_once
def load() -> ModuleType | None:
    """The pool extension, built on the first call; None where it is off or cannot build."""
    return _build()


def bind(ext: ModuleType) -> None:
    """Make kernel extension ``ext`` hand its items to the pool (if there is one)."""
    pool = load()
    if pool is not None:
        ext.set_pool(pool.api())


def _build() -> ModuleType | None:
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes"):
        return None
    try:
        ext = compile_extension("cpu_pool", _SOURCE, ["-O3", "-fopenmp"])
    except Exception as e:  # no compiler, no ninja, a failed build: OpenMP runs the items
        reason = " ".join(str(e).split())[:300]
        log.warning("kernel thread pool unavailable, OpenMP runs: %s: %s", type(e).__name__, reason)
        return None
    ext.set_spin_us(_spin_us())
    return ext


def _spin_us() -> int:
    raw = os.environ.get(SPIN_ENV, "").strip()
    try:
        return max(0, int(raw)) if raw else DEFAULT_SPIN_US
    except ValueError:
        log.warning(
            "%s=%r is not a number of microseconds; using %d", SPIN_ENV, raw, DEFAULT_SPIN_US
        )
        return DEFAULT_SPIN_US
