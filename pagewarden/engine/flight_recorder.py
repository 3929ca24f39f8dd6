"""The flight recorder: the last N engine steps, written to a file when something goes
wrong, in a form ``pagewarden replay`` re-drives (format: docs/flight-recorder.md).

What is kept, per step: the scheduler's journal (``sched/journal.py``: requests added
and finished, what was scheduled with each request's block table as (block id, epoch)
pairs, the tokens sampled, faults recovered, batch-limit changes, metadata changes made
by fault injection), the blocks the pool allocated and freed (``BlockTrace``), the
effective batch limits, the engine profile, cumulative integrity counters and timing.
The journal holds references to objects the engine never mutates afterwards; JSON is
only built when a record is written, so recording costs a few list appends per step.

Window and checkpoints::

    checkpoint A  steps a .. a+N-1 | checkpoint B  steps b .. now
    \\__________ older segment ____/ \\________ newer segment ____/

A checkpoint (``sched/snapshot.py``) of scheduler and KV metadata is taken every N
steps; the recorder keeps two segments, so a record holds between N and 2N steps (fewer
early in a run) and starts at a checkpoint replay can restore. Memory: at most 2N steps.

When it writes (``dump``): at the end of a step in which a fault was detected or an
invariant audit failed, on an engine crash (the caller's ``dump``), and whenever another
component calls ``dump(reason)`` (a profile switch). Fault-triggered writes are at least
N/2 steps apart; a trigger inside that gap is written with the next record, which still
covers its step (N/2 < N), so every fault step lands in some file.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagewarden.kv.block_pool import BlockTrace
from pagewarden.private_dir import create_private_file, ensure_private_dir
from pagewarden.sched import snapshot
from pagewarden.sched.journal import RECORD_FORMAT, RECORD_VERSION, encode
from pagewarden.sched.scheduler import Scheduler

logger = logging.getLogger("pagewarden.flight_recorder")

#: The integrity counters each step carries (cumulative, in this order). ``detections``
#: counts every fault found, of any kind, as ``IntegrityStats.detections`` does.
INTEGRITY_FIELDS = (
    "detections",
    "invariant_violations",
    "audits",
    "recoveries",
    "tag_checks",
    "block_verifies",
    "slot_verifies",
    "scrubbed_blocks",
)

#: The records a directory keeps: past either cap the oldest of this recorder's kind
#: (``flight-*.jsonl``) are deleted after each write, so nothing grows without bound.
MAX_RECORD_FILES = 64
MAX_RECORD_BYTES = 256 * 1024 * 1024


def integrity_counts(monitor: Any) -> tuple[int, ...]:
    """``INTEGRITY_FIELDS`` of an ``IntegrityMonitor`` (and its worker guard), now."""
    c = monitor.guard.counters
    kv = monitor.scheduler.kv
    pool = kv.pool
    detections = (
        sum(c.failures.values())
        + sum(monitor.failures.values())
        + pool.ownership_violations
        + kv.stale_refs_dropped
        + kv.refcounts_fixed_at_free
        + pool.held_blocks_skipped
        + pool.held_blocks_found_at_free
    )
    return (
        detections,
        monitor.invariant_violations,
        monitor.audits,
        monitor.recoveries,
        c.tag_checks,
        c.block_verifies,
        c.slot_verifies,
        c.scrubbed_blocks,
    )


class _Step:
    """One step's entry: journal and pool trace while it runs, then limits and timing.
    ``step`` is the number the step's ``schedule()`` gets (0: calls before step 1)."""

    __slots__ = ("step", "time", "t0", "duration_s", "ops", "trace", "limits", "profile", "counts")

    def __init__(self, step: int) -> None:
        self.step = step
        self.time = time.time()
        self.t0 = time.perf_counter()
        self.duration_s: float | None = None
        self.ops: list[tuple] = []
        self.trace = BlockTrace()
        self.limits: tuple[int, int] | None = None
        self.profile: str | None = None
        self.counts: tuple[int, ...] | None = None

    def copy(self) -> _Step:
        """A copy that later journal appends and block frees do not reach."""
        other = _Step(self.step)
        for name in ("time", "t0", "duration_s", "limits", "profile", "counts"):
            setattr(other, name, getattr(self, name))
        other.ops = list(self.ops)
        other.trace.allocated = list(self.trace.allocated)
        other.trace.freed = list(self.trace.freed)
        return other

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "step",
            "step": self.step,
            "time": self.time,
            "duration_ms": None if self.duration_s is None else self.duration_s * 1e3,
            "limits": None if self.limits is None else list(self.limits),
            "profile": self.profile,
            "integrity": None if self.counts is None else dict(zip(INTEGRITY_FIELDS, self.counts)),
            "ops": [encode(op) for op in self.ops],
            "allocated": self.trace.allocated,
            "freed": self.trace.freed,
        }


class FlightRecorder:
    """Records ``scheduler``'s last ``num_steps``..``2 * num_steps`` steps; engine-core
    thread only (it reads scheduler state and swaps the journal between steps).

    ``profile`` is the engine profile in force (set by whoever switches it; recorded
    with every step). ``counts`` returns the cumulative ``INTEGRITY_FIELDS``.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        num_steps: int,
        directory: str | Path,
        counts: Callable[[], tuple[int, ...]],
        info: dict[str, Any] | None = None,
        max_files: int = MAX_RECORD_FILES,
        max_bytes: int = MAX_RECORD_BYTES,
    ) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.scheduler = scheduler
        self.num_steps = num_steps
        self.directory = Path(directory)
        self.max_files, self.max_bytes = max_files, max_bytes
        self.info = info or {}
        self.profile: str | None = None
        self.cooldown = max(1, num_steps // 2)
        self.dumps: list[Path] = []  # files written, in the order they were finished
        self._writers: list[threading.Thread] = []
        self._num_dumps = 0
        self._counts = counts
        self._last_counts = counts()
        self._pending: dict[str, list[int]] = {}  # trigger -> steps, waiting to be written
        self._since_dump = self.cooldown  # steps since the last write
        self._older: tuple[dict[str, Any], list[_Step]] | None = None
        self._newer: tuple[dict[str, Any], list[_Step]] = (snapshot.capture(scheduler), [])
        self._current = self._open(scheduler.num_steps)

    def _open(self, step: int) -> _Step:
        entry = _Step(step)
        self._newer[1].append(entry)
        self.scheduler.journal = entry.ops
        self.scheduler.kv.pool.trace = entry.trace
        return entry

    def begin_step(self) -> None:
        """Start the next step's entry (first thing in ``EngineCore.step``)."""
        if len(self._newer[1]) >= self.num_steps:
            self._older = self._newer
            self._newer = (snapshot.capture(self.scheduler), [])
        self._current = self._open(self.scheduler.num_steps + 1)

    def end_step(self) -> None:
        """Close the step's timing and limits; write a record if a fault was detected."""
        entry = self._current
        entry.duration_s = time.perf_counter() - entry.t0
        entry.limits = (self.scheduler.max_num_seqs, self.scheduler.max_num_batched_tokens)
        entry.profile = self.profile
        self._since_dump += 1
        entry.counts = self._check_counts()
        if self._pending and self._since_dump >= self.cooldown:
            self.dump(self._pending_reason(), background=True)

    def trigger(self, what: str) -> None:
        """Write a record for ``what`` (e.g. a profile switch) at the end of this step,
        or after the cooldown, with any fault found meanwhile."""
        self._pending.setdefault(what, []).append(self._current.step)

    def close(self) -> Path | None:
        """Write what is pending (a trigger inside the cooldown, or a detection made
        outside a step) and wait for background writes; call when the engine stops."""
        self._check_counts()
        path = self.dump(self._pending_reason()) if self._pending else None
        for writer in self._writers:
            writer.join()
        self._writers = []
        return path

    def _check_counts(self) -> tuple[int, ...]:
        counts = self._counts()
        last, self._last_counts = self._last_counts, counts
        step = self._current.step
        if counts[0] > last[0]:
            self._pending.setdefault("fault detected", []).append(step)
        if counts[1] > last[1]:
            self._pending.setdefault("invariant audit failed", []).append(step)
        return counts

    def _pending_reason(self) -> str:
        parts = []
        for what, steps in self._pending.items():
            shown = ", ".join(str(s) for s in steps[:6])
            more = f" and {len(steps) - 6} more" if len(steps) > 6 else ""
            parts.append(f"{what} in step{'s' if len(steps) > 1 else ''} {shown}{more}")
        return "; ".join(parts)

    def dump(self, reason: str, background: bool = False) -> Path | None:
        """Write the window to a new file in ``directory``; returns its path, or None if
        it could not be written (logged, never raised: the engine goes on).

        With ``background`` the JSON is built and written by a thread, so the step loop
        does not wait for it (``close`` waits); the returned path then exists once that
        thread is done. A crash dump must not use it: the process is about to exit.
        """
        checkpoint, entries = self._older if self._older is not None else self._newer
        if self._older is not None:
            entries = entries + self._newer[1]
        # The open entry still grows: write a copy of it. Closed entries never change.
        entries = [e.copy() if e is self._current else e for e in entries]
        first, last = entries[0].step, entries[-1].step
        now = datetime.datetime.now(datetime.timezone.utc)
        header = {
            "format": RECORD_FORMAT,
            "version": RECORD_VERSION,
            "reason": reason,
            "created": now.isoformat(timespec="milliseconds"),
            "pid": os.getpid(),
            "first_step": first,
            "last_step": last,
            "num_entries": len(entries),
            "window_steps": self.num_steps,
            "engine": self.info,
        }
        self._num_dumps += 1
        name = f"flight-{now:%Y%m%dT%H%M%S}-pid{os.getpid()}-step{last}-{self._num_dumps}.jsonl"
        path = self.directory / name
        self._pending = {}
        self._since_dump = 0
        if background:
            writer = threading.Thread(
                target=self._write,
                args=(path, header, checkpoint, entries),
                name="pagewarden-flight-recorder",
                daemon=False,  # the interpreter waits for it at exit: no half-written record
            )
            self._writers.append(writer)
            writer.start()
            return path
        return self._write(path, header, checkpoint, entries)

    def _prune(self) -> None:
        """Delete the oldest records past ``max_files`` or ``max_bytes`` (never the newest)."""
        try:
            records = sorted(
                (p.stat().st_mtime, p.name, p.stat().st_size, p)
                for p in self.directory.glob("flight-*.jsonl")
                if p.is_file() and not p.is_symlink()
            )
        except OSError:
            return
        total = sum(size for _, _, size, _ in records)
        while len(records) > 1 and (len(records) > self.max_files or total > self.max_bytes):
            _, _, size, oldest = records.pop(0)
            try:
                oldest.unlink()
            except OSError:
                pass
            total -= size
            logger.info("flight recorder: deleted %s (over the directory's caps)", oldest.name)

    def _write(
        self,
        path: Path,
        header: dict[str, Any],
        checkpoint: dict[str, Any],
        entries: list[_Step],
    ) -> Path | None:
        t0 = time.perf_counter()
        try:
            ensure_private_dir(self.directory)  # 0700, ours: records hold prompt token ids
            tmp = path.with_suffix(".tmp")
            with create_private_file(tmp) as f:  # 0600, O_EXCL | O_NOFOLLOW
                f.write(json.dumps(header) + "\n")
                f.write(
                    json.dumps(
                        {"type": "checkpoint", "step": header["first_step"], "state": checkpoint}
                    )
                    + "\n"
                )
                for entry in entries:
                    f.write(json.dumps(entry.to_json()) + "\n")
            os.replace(tmp, path)
        except (OSError, TypeError, ValueError) as exc:
            logger.error("flight recorder: could not write %s: %r", path, exc)
            return None
        self.dumps.append(path)
        self._prune()
        logger.warning(
            "flight recorder: steps %d..%d written to %s (%s; %.0f ms); replay with "
            "`pagewarden replay %s`",
            header["first_step"],
            header["last_step"],
            path.resolve(),
            header["reason"],
            (time.perf_counter() - t0) * 1e3,
            path,
        )
        return path
