"""The tiers of one engine: verified loads, an off-critical-path writer, counters.

Loads run on the loader's threads (``loader.py``: requests side by side, several blocks
of a chain in flight) when a request is first looked at for scheduling (one ``get`` per
block, tiers in order: disk, then Redis); every entry is verified by ``format.decode_entry`` against
the requesting chain before it is used, and the worker recomputes its checksum once more
over the bytes that landed in the pool (``LandedBlock``). Stores go through a bounded
queue to one writer thread, run nicer than the engine (``WRITER_NICENESS``); a full
queue drops the block (counted), never the step.

A tier that raises ``TierError`` is a miss for that call, counted, logged at most once
per ``log_interval_s`` per reason, and skipped for a backoff that doubles from 1 s up to
30 s while it keeps failing.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagewarden.kv.block import BlockHash
from pagewarden.kv.cache_events import BlockRemoved, BlockStored, CacheEvent
from pagewarden.kvstore.checksum import block_checksum
from pagewarden.kvstore.format import (
    BlockIdentity,
    EntryRejected,
    Namespace,
    RejectReason,
    decode_entry,
    encode_entry,
)
from pagewarden.kvstore.keys import block_key
from pagewarden.kvstore.loader import LoadedBlock, TierLoader
from pagewarden.kvstore.tier import KVTier, TierError
from pagewarden.metrics.stats import HistogramSnapshot, KVTierStats

logger = logging.getLogger("pagewarden.kvstore")

#: How much nicer than the engine the writer thread runs (Linux: a thread has its own
#: nice value): stores are off the critical path, so on a saturated CPU they yield to the
#: engine's compute threads rather than slow its steps.
WRITER_NICENESS = 10

#: Upper bounds (seconds) of the per-block load latency histogram.
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass
class TierCounters:
    """Monotonic counts per tier (``rejected`` by (tier, reason)); read by the metrics."""

    hits: dict[str, int] = field(default_factory=dict)
    stores: dict[str, int] = field(default_factory=dict)
    rejected: dict[tuple[str, str], int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    misses: int = 0  # blocks looked up that no tier had (the first miss ends a chain)
    offload_dropped: int = 0  # evicted blocks not offloaded: the writer's queue was full
    offload_unverified: int = 0  # evicted blocks whose bytes no longer matched their seal
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    load_seconds_sum: float = 0.0
    load_count: int = 0


@dataclass(frozen=True)
class Offload:
    """An evicted block's bytes, snapshot before anything overwrote them."""

    ident: BlockIdentity
    payload: bytes
    sealed_checksum: int | None  # the guard's seal (unsigned), None where none is kept


class TierStore:
    """Verified loads from, and queued stores to, an ordered list of tiers."""

    def __init__(
        self,
        namespace: Namespace,
        tiers: Sequence[KVTier],
        queue_size: int = 256,
        log_interval_s: float = 10.0,
        load_timeout_s: float = 0.5,
    ) -> None:
        self.ns = namespace
        self.tiers = list(tiers)
        self.counters = TierCounters()
        for t in self.tiers:
            self.counters.hits[t.name] = 0
            self.counters.stores[t.name] = 0
            self.counters.errors[t.name] = 0
        self.log_interval_s = log_interval_s
        self._count_lock = threading.Lock()
        self._last_log: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._down_until: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._queue: queue.Queue[Offload | None] = queue.Queue(maxsize=queue_size)
        # KV events of the tiers (medium "DISK", "REDIS"), for engine/kv_events.py;
        # appended by both threads, taken by the engine thread.
        self._events: list[CacheEvent] = []
        self._events_lock = threading.Lock()
        # Asynchronous loads (``loader.py``); one that makes no progress for
        # ``load_timeout_s`` gives up: the request computes the rest of its blocks.
        self.loader = TierLoader(self._load_one, load_timeout_s, account=self._account)
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ loads
    def load(self, chain: Sequence[BlockIdentity]) -> list[LoadedBlock]:
        """Verified entries for the longest prefix of ``chain`` some tier holds."""
        out: list[LoadedBlock] = []
        for ident in chain:
            found = self.load_one(ident)
            if found is None:
                break
            out.append(found)
        return out

    def load_one(self, ident: BlockIdentity) -> LoadedBlock | None:
        """The verified entry of one block from the first tier that has it, counted as a
        hit (with its latency) or a miss; None on a miss."""
        start = time.perf_counter()
        found = self._load_one(ident)
        self._account(found, time.perf_counter() - start)
        return found

    def _account(self, found: LoadedBlock | None, seconds: float) -> None:
        """Count a block a load took: a hit (with its latency) or the miss ending it."""
        with self._count_lock:  # several loader threads
            if found is None:
                self.counters.misses += 1
                return
            self._observe(seconds)
            self.counters.hits[found.tier] += 1

    def _load_one(self, ident: BlockIdentity) -> LoadedBlock | None:
        key = block_key(self.ns, ident.block_hash)
        for tier in self.tiers:
            if self._is_down(tier):
                continue
            try:
                data = tier.get(key)
            except TierError as e:
                self._tier_failed(tier, e)
                continue
            self._tier_ok(tier)
            if data is None:
                continue
            try:
                block = decode_entry(data, self.ns, ident)
            except EntryRejected as e:
                self.reject(tier.name, key, e.reason, e.detail, ident.block_hash)
                continue
            return LoadedBlock(bytes(block.payload), block.checksum, tier.name, key)
        return None

    def reject(
        self,
        tier_name: str,
        key: str,
        reason: RejectReason,
        detail: str,
        block_hash: BlockHash | None = None,
    ) -> None:
        """Count and log a rejected entry and delete it from its tier."""
        label = (tier_name, reason.value)
        with self._count_lock:  # loader fetch threads and the engine thread
            self.counters.rejected[label] = self.counters.rejected.get(label, 0) + 1
        self._log(
            f"reject/{tier_name}/{reason.value}",
            "KV tier %s: entry %s… rejected (%s: %s); treated as a miss, deleted",
            tier_name,
            key[:16],
            reason.value,
            detail,
        )
        if block_hash is not None:
            self._event(BlockRemoved(block_hash, tier_name.upper()))
        for tier in self.tiers:
            if tier.name == tier_name:
                try:
                    tier.delete(key)
                except TierError as e:
                    self._tier_failed(tier, e)

    def _observe(self, seconds: float) -> None:
        c = self.counters
        c.load_count += 1
        c.load_seconds_sum += seconds
        for i, bound in enumerate(LOAD_BUCKETS):
            if seconds <= bound:
                c.load_buckets[i] += 1
                return
        c.load_buckets[-1] += 1

    # ----------------------------------------------------------------- stores
    def offer(self, offloads: Sequence[Offload], deadline: float | None = None) -> int:
        """Queue blocks for the writer; returns how many were queued. A full queue drops
        them (counted), at once or, with a ``deadline`` (``time.monotonic()``), once it
        has passed (a clean stop waits for room)."""
        queued = 0
        for item in offloads:
            try:
                if deadline is None:
                    self._queue.put_nowait(item)
                else:
                    self._queue.put(item, timeout=max(0.0, deadline - time.monotonic()))
                queued += 1
            except queue.Full:
                self.counters.offload_dropped += 1
        return queued

    def _write_loop(self) -> None:
        _lower_priority(WRITER_NICENESS)
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            except Exception:  # the writer must outlive any one bad block
                logger.exception("KV tier writer: storing a block failed")
            finally:
                self._queue.task_done()

    def _write(self, item: Offload) -> None:
        layout = self.ns.layout
        checksum = block_checksum(item.payload, layout.num_layers, layout.block_size)
        if item.sealed_checksum is not None and checksum != item.sealed_checksum:
            # The pool's copy changed since it was sealed: never store what we cannot vouch for.
            self.counters.offload_unverified += 1
            self._log("store/unverified", "KV tier: an evicted block failed its seal; not stored")
            return
        data = encode_entry(self.ns, item.ident, checksum, item.payload)
        key = block_key(self.ns, item.ident.block_hash)
        for tier in self.tiers:
            if self._is_down(tier):
                continue
            try:
                if tier.put(key, data):
                    self.counters.stores[tier.name] += 1
                    ident = item.ident
                    tokens = struct.unpack(f"<{len(ident.token_bytes) // 4}I", ident.token_bytes)
                    self._event(
                        BlockStored(ident.block_hash, ident.parent_hash, tokens, tier.name.upper())
                    )
            except TierError as e:
                self._tier_failed(tier, e)
            else:
                self._tier_ok(tier)

    def _event(self, event: CacheEvent) -> None:
        with self._events_lock:
            if len(self._events) < 100_000:  # nobody taking them: do not grow forever
                self._events.append(event)

    def take_events(self) -> list[CacheEvent]:
        """The tiers' stores and drops since the last call (KV events with their medium)."""
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued block was written; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (up to ``timeout_s``), stop the writer, close the tiers."""
        self.flush(timeout_s)
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._writer.join(timeout=1.0)
        self.loader.close()
        for tier in self.tiers:
            tier.close()

    def bytes_used(self) -> dict[str, int]:
        return {t.name: t.bytes_used() for t in self.tiers}

    def stats(self) -> KVTierStats:
        """A snapshot of the counters (copies: safe to hand to another thread)."""
        c = self.counters
        return KVTierStats(
            hits=dict(c.hits),
            stores=dict(c.stores),
            rejected=dict(c.rejected),
            errors=dict(c.errors),
            bytes=self.bytes_used(),
            misses=c.misses,
            offload_dropped=c.offload_dropped,
            offload_unverified=c.offload_unverified,
            load_timeouts=self.loader.timeouts,
            load_latency=HistogramSnapshot(
                LOAD_BUCKETS, tuple(c.load_buckets), c.load_seconds_sum, c.load_count
            ),
        )

    # ------------------------------------------------------------- failures
    def _is_down(self, tier: KVTier) -> bool:
        until = self._down_until.get(tier.name)
        return until is not None and time.monotonic() < until

    def _tier_failed(self, tier: KVTier, error: TierError) -> None:
        with self._count_lock:  # loader fetch threads, the writer and the engine thread
            self.counters.errors[tier.name] += 1
            backoff = self._backoff.get(tier.name, 0.5)
            if not self._is_down(tier):  # calls that were in flight together count once
                backoff = self._backoff[tier.name] = min(backoff * 2, 30.0)
                self._down_until[tier.name] = time.monotonic() + backoff
        self._log(
            f"error/{tier.name}",
            "KV tier %s failed (%s); misses for the next %.0f s",
            tier.name,
            error,
            backoff,
        )

    def _tier_ok(self, tier: KVTier) -> None:
        if tier.name in self._backoff:
            with self._count_lock:
                self._backoff.pop(tier.name, None)
                self._down_until.pop(tier.name, None)

    def _log(self, kind: str, msg: str, *args: object) -> None:
        with self._count_lock:
            now = time.monotonic()
            last = self._last_log.get(kind)
            if last is not None and now - last < self.log_interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last_log[kind] = now
            skipped = self._suppressed.pop(kind, 0)
        if skipped:
            msg += f" (+{skipped} like it not logged)"
        logger.warning(msg, *args)


def _lower_priority(niceness: int) -> None:
    """Make the calling thread ``niceness`` nicer (Linux; elsewhere, or without the
    right, it keeps its priority)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
    except (AttributeError, OSError):
        pass
