"""OpenMP wait policy: idle torch threads sleep instead of spinning.

torch's OpenMP threads spin-wait at the end of every parallel region by default. On a
machine where anything else runs (the HTTP front end, a load generator, another engine)
the spinning threads steal the cores the work needs, and a 2-thread engine runs many
times slower. ``OMP_WAIT_POLICY=PASSIVE`` makes them sleep; it is read once, when the
OpenMP runtime starts (when torch is imported), so this module must run before torch
loads: ``pagewarden/__init__.py`` imports it first.

The user's own ``OMP_WAIT_POLICY`` always wins. On a dedicated machine, where spinning
trims a little latency off each parallel region, set ``OMP_WAIT_POLICY=ACTIVE`` (or
``PAGEWARDEN_OMP_ACTIVE=1``) before starting pagewarden.
"""

from __future__ import annotations

import os

#: Set to 1 to keep OpenMP's spinning (active) wait on a dedicated machine.
ACTIVE_ENV = "PAGEWARDEN_OMP_ACTIVE"


def apply_omp_wait_policy(environ: os._Environ[str] | dict[str, str] = os.environ) -> str:
    """Set OMP_WAIT_POLICY unless the user did; returns the policy in force."""
    if "OMP_WAIT_POLICY" not in environ:
        active = environ.get(ACTIVE_ENV, "").strip().lower() in ("1", "true", "yes")
        environ["OMP_WAIT_POLICY"] = "ACTIVE" if active else "PASSIVE"
    return environ["OMP_WAIT_POLICY"]


apply_omp_wait_policy()
