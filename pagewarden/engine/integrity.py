"""Engine-side integrity: recovery from detected faults, periodic audits, counters.

The monitor runs on the engine-core thread around each step::

    before_schedule()   scheduler.verify_block_tables(): a table entry whose epoch-tagged
                        ref no longer matches its block (use after free) or whose id was
                        altered is caught before any step reads it; the request rolls back
    runner.execute()    the worker's KVGuard checks tags and checksums (KVFault list)
    recover(out, res)   scheduler.recover(): quarantine the failed blocks, drop their
                        prefix-cache entries, roll every holder back to the start of the
                        bad block; the step's output loses the rolled-back requests, so
                        no token computed from bad KV is appended or released
    after_step()        every ``audit_interval`` steps: scheduler.check_invariants(); a
                        violation triggers scheduler.repair() (quarantine blocks held
                        beyond their ref count, roll their holders back, rebuild ref counts
                        and the free queue from the references tables hold); quarantined
                        blocks nobody holds are zeroed and read back by the worker, then
                        released (the pool retires a block that keeps failing)

Every detection and recovery is logged with the request ids and block ids involved and
counted by kind; ``IntegrityStats`` is the snapshot ``llm.stats()`` reports.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pagewarden.sched.output import FailureKey, KVFault, ModelRunnerOutput, SchedulerOutput
from pagewarden.sched.recovery import RecoveryReport
from pagewarden.sched.scheduler import Scheduler
from pagewarden.sched.stats import metric
from pagewarden.worker.kv_guard import KVGuard
from pagewarden.worker.step_hooks import StepHooks

logger = logging.getLogger("pagewarden.integrity")

#: Detections the monitor remembers for the dashboard (``events``), newest last.
MAX_RECENT_EVENTS = 32


@dataclass(frozen=True)
class IntegrityRecord:
    """One detection and what recovery did about it, as the dashboard lists it."""

    time: float  # wall clock (time.time()) when recovery ran
    step: int  # scheduler steps completed
    kind: str
    found_by: str
    block_ids: tuple[int, ...]
    rolled_back: dict[str, int]  # request -> token position it recomputes from
    detail: str = ""


@dataclass(frozen=True)
class IntegrityStats:
    """Integrity counters (monotonic)."""

    level: str
    tag_checks: int  # context positions whose slot tag was compared
    block_verifies: int  # block checksums recomputed and compared
    slot_verifies: int  # slot checksums recomputed and compared
    seals: int  # blocks sealed with a checksum
    scrubbed_blocks: int  # sealed blocks re-verified by the scrubber
    audits: int  # check_invariants() runs
    invariant_violations: int
    failures: dict[FailureKey, int] = field(default_factory=dict)
    recoveries: int = metric(
        "counter", "Faults recovered by rollback and recompute.", "integrity_recoveries"
    )
    rolled_back_requests: int = metric(
        "counter", "Requests rolled back by recovery.", "integrity_rolled_back_requests"
    )
    recomputed_tokens: int = metric(
        "counter", "Computed tokens discarded by recovery.", "integrity_recomputed_tokens"
    )
    quarantined_blocks: int = metric(
        "counter", "Blocks put in quarantine.", "kv_blocks_quarantine_events"
    )
    quarantine_releases: int = metric(
        "counter",
        "Quarantined blocks scrubbed, re-verified and returned to service.",
        "kv_blocks_quarantine_releases",
    )
    retired_blocks: int = metric(
        "gauge", "Blocks retired for good after repeated failures.", "kv_blocks_retired"
    )
    ownership_violations: int = 0  # pool/scheduler mutations refused on a foreign thread
    failed_requests: int = metric(
        "counter",
        "Requests failed by an unrecoverable fault (no healthy blocks).",
        "integrity_failed_requests",
    )

    @property
    def detections(self) -> int:
        """Faults detected, all kinds (ownership violations included)."""
        return sum(self.failures.values()) + self.ownership_violations


class IntegrityMonitor:
    """Runs recovery and audits for one engine; engine-core thread only."""

    def __init__(
        self, scheduler: Scheduler, guard: KVGuard, level: str, audit_interval: int
    ) -> None:
        self.scheduler = scheduler
        self.guard = guard
        self.level = level
        self.on = level != "off"
        self.audit_interval = audit_interval
        self.audits = 0
        self.invariant_violations = 0
        self.recoveries = 0
        self.rolled_back_requests = 0
        self.recomputed_tokens = 0
        self.quarantined_blocks = 0
        self.quarantine_releases = 0
        self.failed_requests = 0
        self.failures: dict[FailureKey, int] = {}  # scheduler-found kinds (worker's in guard)
        self._steps = 0
        self.hooks: StepHooks | None = None  # told of every detection made here
        self.events: deque[IntegrityRecord] = deque(maxlen=MAX_RECENT_EVENTS)

    def before_schedule(self) -> None:
        """Catch stale or altered block-table entries before a step can read them."""
        if not self.on:
            return
        for event in self.scheduler.verify_block_tables():
            key = FailureKey(event.kind, "schedule")
            self.failures[key] = self.failures.get(key, 0) + 1
            self.recoveries += 1
            if event.kind != "free_list":
                self.rolled_back_requests += 1
            logger.warning(
                "integrity: %s: request %s, block %d; %s from position %d",
                event.kind,
                event.req_id,
                event.block_id,
                "taken off the free queue, keeping" if event.kind == "free_list" else "recomputing",
                event.position,
            )
            rolled_back = {} if event.kind == "free_list" else {event.req_id: event.position}
            self._record(key, (event.block_id,), rolled_back)
            if self.hooks is not None:
                self.hooks.on_detection({event.block_id}, key, event.req_id)

    def recover(
        self, out: SchedulerOutput, result: ModelRunnerOutput
    ) -> tuple[SchedulerOutput, RecoveryReport]:
        """Apply the step's faults; returns the output without the rolled-back requests."""
        report = self._recover(result.faults)
        gone = set(report.rolled_back)
        kept = [r for r in out.requests if r.req_id not in gone]
        return dataclasses.replace(out, requests=kept), report

    def scrub_idle(self, num_blocks: int) -> list[KVFault]:
        """Scrub ``num_blocks`` sealed blocks outside a step and recover what it finds."""
        faults = self.guard.scrub(num_blocks)
        if faults:
            self._recover(faults)
            self.after_step()
        return faults

    def _recover(self, faults: list[KVFault]) -> RecoveryReport:
        """Quarantine and roll back through the scheduler; log and count."""
        report = self.scheduler.recover(faults)
        self.guard.unseal(report.quarantined)
        for f in faults:
            logger.warning(
                "integrity: %s fault found by %s in blocks %s (%s); rolling back %s",
                f.kind,
                f.found_by,
                list(f.block_ids),
                f.detail,
                dict(sorted(report.rolled_back.items())),
            )
            # One fault owns the whole report; of several, each owns the readers it names.
            rolled_back = report.rolled_back
            if len(faults) > 1:
                rolled_back = {r: p for r, p in rolled_back.items() if r in f.rollback}
            self._record(FailureKey(f.kind, f.found_by), f.block_ids, rolled_back, f.detail)
        self.quarantined_blocks += len(report.quarantined)
        self.rolled_back_requests += len(report.rolled_back)
        self.recomputed_tokens += report.recomputed_tokens
        if report.failed:
            self.failed_requests += len(report.failed)
            logger.error(
                "integrity: no healthy KV blocks left for requests %s; they fail",
                list(report.failed),
            )
        else:
            self.recoveries += len(faults)
        return report

    def after_step(self) -> None:
        """Periodic audit; scrub and release quarantined blocks nobody holds."""
        if not self.on:
            return
        self._steps += 1
        if self._steps % self.audit_interval == 0:
            self.audit()
        ready = self.scheduler.quarantined_block_ids()
        if ready:
            verified = self.guard.scrub_quarantined(ready)
            if verified:
                self.scheduler.release_quarantined(verified)
                self.quarantine_releases += len(verified)
                logger.info("integrity: blocks %s scrubbed, re-verified and released", verified)

    def audit(self) -> list[str]:
        """Check metadata invariants now; returns (and counts) the violations."""
        self.audits += 1
        violations = self.scheduler.check_invariants()
        if violations:
            self.invariant_violations += len(violations)
            logger.error(
                "integrity: %d invariant violation(s): %s; recovering",
                len(violations),
                "; ".join(violations[:5]),
            )
            self._repair()
        return violations

    def _repair(self) -> None:
        """Recovery after a failed audit: quarantine blocks held beyond their reference
        count, roll their holders back, rebuild ref counts and the free queue from the
        references the tables hold."""
        over = set(self.scheduler.kv.overshared_blocks())
        changed = set(self.scheduler.kv.refcount_mismatches())
        report = self.scheduler.repair()
        self.quarantined_blocks += len(report.quarantined)
        self.rolled_back_requests += len(report.rolled_back)
        self.recomputed_tokens += report.recomputed_tokens
        if report.failed:
            self.failed_requests += len(report.failed)
        self.failures[FailureKey("refcount", "audit")] = (
            self.failures.get(FailureKey("refcount", "audit"), 0) + 1
        )
        self.recoveries += 1
        left = self.scheduler.check_invariants()
        logger.warning(
            "integrity: audit repair: quarantined %s, rolled back %s; %d violation(s) left%s",
            list(report.quarantined),
            dict(sorted(report.rolled_back.items())),
            len(left),
            "" if not left else ": " + "; ".join(left[:5]),
        )
        self._record(
            FailureKey("refcount", "audit"), tuple(sorted(over | changed)), report.rolled_back
        )
        if self.hooks is not None:
            self.hooks.on_detection(over | changed, FailureKey("refcount", "audit"), None)

    def _record(
        self,
        key: FailureKey,
        block_ids: tuple[int, ...],
        rolled_back: dict[str, int],
        detail: str = "",
    ) -> None:
        """Remember a detection for the dashboard (the last ``MAX_RECENT_EVENTS``)."""
        self.events.append(
            IntegrityRecord(
                time.time(),
                self.scheduler.num_steps,
                key.kind,
                key.found_by,
                tuple(block_ids),
                dict(rolled_back),
                detail,
            )
        )

    def stats(self) -> IntegrityStats:
        c = self.guard.counters
        s = self.scheduler.stats()
        failures = dict(c.failures)
        for key, n in self.failures.items():
            failures[key] = failures.get(key, 0) + n
        if self.scheduler.kv.pool.held_blocks_skipped:
            failures[FailureKey("free_list", "allocate")] = (
                self.scheduler.kv.pool.held_blocks_skipped
            )
        if self.scheduler.kv.pool.held_blocks_found_at_free:
            failures[FailureKey("free_list", "free")] = (
                self.scheduler.kv.pool.held_blocks_found_at_free
            )
        if self.scheduler.kv.refcounts_fixed_at_free:
            failures[FailureKey("refcount", "free")] = self.scheduler.kv.refcounts_fixed_at_free
        if self.scheduler.kv.stale_refs_dropped:
            failures[FailureKey("stale_ref", "free")] = self.scheduler.kv.stale_refs_dropped
        return IntegrityStats(
            level=self.level,
            tag_checks=c.tag_checks,
            block_verifies=c.block_verifies,
            slot_verifies=c.slot_verifies,
            seals=c.seals,
            scrubbed_blocks=c.scrubbed_blocks,
            audits=self.audits,
            invariant_violations=self.invariant_violations,
            failures=failures,
            recoveries=self.recoveries,
            rolled_back_requests=self.rolled_back_requests,
            recomputed_tokens=self.recomputed_tokens,
            quarantined_blocks=self.quarantined_blocks,
            quarantine_releases=self.quarantine_releases,
            retired_blocks=s.retired_blocks,
            ownership_violations=s.ownership_violations,
            failed_requests=self.failed_requests,
        )
