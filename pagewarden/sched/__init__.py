"""Token-budget continuous batching (pure Python, no torch)."""

from __future__ import annotations

from pagewarden.sched.admission import RequestRejected
from pagewarden.sched.config import SchedulerConfig
from pagewarden.sched.output import RequestUpdate
from pagewarden.sched.request import Request, RequestStatus
from pagewarden.sched.scheduler import Scheduler
from pagewarden.sched.stats import SchedulerStats

__all__ = [
    "Request",
    "RequestRejected",
    "RequestStatus",
    "RequestUpdate",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
]
