"""Profile switches applied to a running engine, between two steps.

``SafeMode`` owns the ``ProfileController`` (``engine/profiles.py``), feeds it the fault
counts of every step and turns each switch into settings of the engine's parts, on the
engine-core thread, after one step and before the next:

=====================  ===============================================================
setting                applied through
=====================  ===============================================================
integrity              ``KVGuard.set_level`` (``standard`` <-> ``strict`` only) and the
                       integrity monitor's level
max_num_seqs           the adaptive batch controller's ceiling: lowered at once, raised
                       back by its additive increase one clean window at a time; with
                       ``--no-adaptive-batch``, the scheduler's limits directly
preemption_mode        ``Scheduler.set_preemption_mode`` (requests already in the host
                       tier still come back)
scrub_blocks_per_step  the guard's scrubber budget per step
audit_interval         the integrity monitor's steps between audits
prefix_cache=verified  ``Scheduler.drop_cached_prefixes`` on entry: the entries of blocks nobody
                       holds go; later hits are blocks sealed (and verified at seal)
                       since, or held blocks that every read under ``strict`` verifies
=====================  ===============================================================

No request is dropped by a switch: running requests keep their blocks; past a lowered
seat limit they wait for seats as with any batch decrease. An operator's request
(``request``, from any thread) is applied at the start of the next step.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from pagewarden.engine.batch_controller import AdaptiveBatchController, BatchControllerConfig
from pagewarden.engine.config import EngineConfig
from pagewarden.engine.integrity import IntegrityMonitor
from pagewarden.engine.profiles import (
    NORMAL,
    RUNTIME_INTEGRITY_LEVELS,
    SAFE,
    ProfileController,
    ProfileSettings,
    ProfileState,
    ProfileSwitch,
    load_profiles_file,
    resolve,
    with_builtins,
)
from pagewarden.sched.scheduler import Scheduler
from pagewarden.worker.kv_guard import KVGuard

logger = logging.getLogger("pagewarden.engine.profile")


class SafeMode:
    """Profiles of one engine and their switches (module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        guard: KVGuard,
        monitor: IntegrityMonitor,
        batch: AdaptiveBatchController | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.scheduler, self.guard, self.monitor, self.batch = scheduler, guard, monitor, batch
        # Told of every switch after it is applied (the flight recorder writes a record).
        self.on_switch: Callable[[ProfileSwitch], None] | None = None
        base = ProfileSettings(
            integrity=config.integrity,
            max_num_seqs=config.max_num_seqs,
            preemption_mode=scheduler.preemption_mode,
            scrub_blocks_per_step=config.scrub_blocks_per_step,
            audit_interval=config.audit_interval,
        )
        user = load_profiles_file(config.profiles_file) if config.profiles_file else {}
        profiles = with_builtins(base, user)
        limits = batch.config if batch is not None else _limits(config)
        has_host_tier = scheduler.config.num_host_blocks > 0
        self.settings = {
            name: resolve(p, base, limits.floor.max_num_seqs, has_host_tier)
            for name, p in profiles.items()
        }
        if SAFE not in user and config.integrity not in RUNTIME_INTEGRITY_LEVELS:
            logger.warning(
                "profile safe keeps integrity %r: it cannot become strict at runtime "
                "(start with --integrity standard for that)",
                config.integrity,
            )
        self.controller = ProfileController(
            tuple(profiles), config.safe_mode_policy, config.profile, clock
        )
        self.current = self.settings[NORMAL]
        self._apply(self.settings[config.profile])
        self._requested: str | None = None
        self._lock = threading.Lock()
        self._seen = (0, 0, 0)  # the monitor's fault counters at the last observation

    # ---- any thread --------------------------------------------------------------
    def request(self, name: str) -> None:
        """Queue an operator's switch to ``name`` (``ProfileError`` if unknown)."""
        self.controller.check(name)
        with self._lock:
            self._requested = name

    def has_pending(self) -> bool:
        """A switch is waiting for the next step (an operator's, or the end of safe mode)."""
        return self._requested is not None or self.controller.due()

    # ---- engine-core thread ------------------------------------------------------
    def before_step(self) -> None:
        """Apply an operator's request, or end safe mode when it has been clean enough."""
        with self._lock:
            name, self._requested = self._requested, None
        if name is not None:
            self._switch(self.controller.request(name))
        elif self.controller.due():
            self._switch(self.controller.observe())

    def after_step(self) -> None:
        """Feed the faults detected since the last call; switch if they say so."""
        m = self.monitor
        now = (m.recoveries, m.failed_requests, m.invariant_violations)
        faults, unrecoverable, audit_failures = (a - b for a, b in zip(now, self._seen))
        self._seen = now
        self._switch(self.controller.observe(faults, unrecoverable, audit_failures))

    def state(self) -> ProfileState:
        return self.controller.state()

    def _switch(self, switch: ProfileSwitch | None) -> None:
        if switch is None:
            return
        new = self.settings[switch.new]
        logger.warning(
            "profile %s -> %s (%s: %s): integrity %s, max_num_seqs %d, preemption %s, "
            "scrub %d blocks/step, audit every %d steps",
            switch.old,
            switch.new,
            switch.reason,
            switch.detail,
            new.integrity,
            new.max_num_seqs,
            new.preemption_mode,
            new.scrub_blocks_per_step,
            new.audit_interval,
        )
        self._apply(new)
        if self.on_switch is not None:
            self.on_switch(switch)

    def _apply(self, new: ProfileSettings) -> None:
        old, self.current = self.current, new
        if new.integrity != old.integrity:
            self.guard.set_level(new.integrity)
            self.monitor.level = new.integrity
        if new.max_num_seqs != old.max_num_seqs:
            self._cap_batch(new.max_num_seqs)
        if new.preemption_mode != old.preemption_mode:
            self.scheduler.set_preemption_mode(new.preemption_mode)
        self.guard.scrub_blocks_per_step = new.scrub_blocks_per_step
        self.monitor.audit_interval = new.audit_interval
        if new.prefix_cache == "verified" and old.prefix_cache != "verified":
            dropped = self.scheduler.drop_cached_prefixes()
            logger.info("profile: dropped the prefix-cache entries of %d free blocks", dropped)

    def _cap_batch(self, cap: int) -> None:
        """Hold the batch at ``cap``: through the batch controller when there is one (it
        climbs back by itself when the cap rises), else directly."""
        sched = self.scheduler
        if self.batch is None:
            tokens = math.ceil(self.config.max_num_batched_tokens * cap / self.config.max_num_seqs)
            sched.set_batch_limits(cap, max(1, tokens))
            return
        change = self.batch.set_ceiling(cap)
        if change is not None:
            sched.set_batch_limits(change.new.max_num_seqs, change.new.max_num_batched_tokens)
            logger.warning(
                "batch limit profile: max_num_seqs %d -> %d (%s)",
                change.old.max_num_seqs,
                change.new.max_num_seqs,
                change.detail,
            )


def _limits(config: EngineConfig) -> BatchControllerConfig:
    """The batch bounds (and floor) an engine without a batch controller would have."""
    return BatchControllerConfig(config.max_num_seqs, config.max_num_batched_tokens)


__all__ = ["SafeMode", "NORMAL", "SAFE"]
