"""Token-budget continuous batching (pure Python, no torch)."""

from __future__ import annotations

from pagewarden.sched.config import SchedulerConfig
from pagewarden.sched.request import Request, RequestStatus
from pagewarden.sched.scheduler import (
    RequestRejectedError,
    RequestUpdate,
    Scheduler,
    SchedulerStats,
)

__all__ = [
    "Request",
    "RequestRejectedError",
    "RequestStatus",
    "RequestUpdate",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
]
