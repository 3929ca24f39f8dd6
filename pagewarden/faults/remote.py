"""Fault injection into a served engine, for tests of the whole server (the dashboard's).

Off unless the environment of ``pagewarden serve`` sets ``PAGEWARDEN_FAULT_INJECTION=1``:
then ``POST /debug/faults`` (``server/dashboard.py``; API key required when keys are set)
sends ``("inject", kind)`` to the engine-core process, which hands it to
``RemoteFaults.apply`` between two steps; ``POST /debug/pause`` holds the step loop still
for a few seconds (``("pause", seconds)``), so that a test can compare the dashboard
with ``/metrics`` at one unchanging state while requests are running. Without the variable the route does not exist
and the engine core ignores (and logs) the message, so a production server cannot be
made to corrupt its own cache.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("pagewarden.faults")

#: The environment variable that enables remote fault injection (value "1").
ENV_VAR = "PAGEWARDEN_FAULT_INJECTION"
#: The longest pause of the step loop a test may ask for (seconds).
MAX_PAUSE_S = 10.0


def enabled() -> bool:
    """True when this process may inject faults on request."""
    return os.environ.get(ENV_VAR) == "1"


class RemoteFaults:
    """Creates a ``FaultInjector`` on the engine at the first request; engine thread only."""

    def __init__(self, core) -> None:
        self.core = core
        self.injector = None

    def may_pause(self, seconds: float) -> bool:
        """Whether the step loop may hold still for ``seconds`` (a test reads the
        dashboard and /metrics of one unchanging state); at most ``MAX_PAUSE_S``."""
        if not enabled() or not 0 < seconds <= MAX_PAUSE_S:
            logger.error(
                "pause of %r s refused (%s=1 and 0 < s <= %g needed)", seconds, ENV_VAR, MAX_PAUSE_S
            )
            return False
        logger.warning("fault injection: step loop paused for %g s", seconds)
        return True

    def apply(self, kind: str) -> None:
        """Inject one fault of ``kind`` now (or in the next step with a target)."""
        if not enabled():
            logger.error("fault injection asked for but %s is not set to 1; ignored", ENV_VAR)
            return
        from pagewarden.faults.injector import FaultInjector

        if self.injector is None:
            self.injector = FaultInjector(self.core, seed=0)
        try:
            fault = self.injector.inject(kind)
        except ValueError as exc:
            logger.error("fault injection: %s", exc)
            return
        logger.warning("fault injection: %s queued (%s)", kind, fault.detail if fault else "none")
