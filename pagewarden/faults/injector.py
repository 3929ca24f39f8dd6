"""Fault injection into a live engine, with ground truth for what each fault touched.

``FaultInjector`` attaches to an ``EngineCore`` through its ``StepHooks``
(``EngineCore.install_hooks``; nothing on the engine is replaced) and injects one fault
at a time between steps, or, for indexing faults, into the worker's view of the next
step or the attention metadata of its forward call. It watches
the engine's checks, so it can say for each fault whether and when it was detected, and
it counts the tokens released from a step that read KV altered by a fault nobody had
detected yet (first-order: the tokens of that step, not what they later influence)::

    inj = FaultInjector(engine, seed=0)
    while engine.has_unfinished():
        if want_fault:
            inj.inject("sealed_bitflip")       # None when no target exists right now
        engine.step()
    inj.faults                                  # InjectedFault records
    inj.corrupted_tokens                        # tokens released from undetected bad KV

Fault kinds (``FAULT_KINDS``) and the defence each exercises:

=====================  ==========================================================  ===========
kind                   what is injected                                            caught by
=====================  ==========================================================  ===========
sealed_bitflip         one bit of a sealed (full, checksummed) block a request     checksum
                       holds
open_bitflip           one bit of a written slot of a block still being filled     checksum
tag_corruption         the slot tag of a written slot                              slot tag
table_redirect         a block-table entry, as the worker sees it, points at       slot tag
                       another live request's block for one step
slot_redirect          a slot index of the next step points into another           slot mapping
                       request's block, so K/V is scattered there
index_redirect         one entry of ``AttentionMetadata.block_index`` (only the    slot tag
                       index attention gathers with) points at another live
                       request's block, for one forward call
slot_mapping_redirect  one entry of ``AttentionMetadata.slot_mapping`` (only the   slot mapping
                       index the model scatters with) points at a written slot
                       of another request, for one forward call
use_after_free         a block a request still lists is freed and handed out       epoch
                       again
coherent_wrong_ref     a table entry rewritten to a valid ``BlockRef`` of another  slot tag, then
                       request's block (refs and ids agree)                        ref counts
free_list_push         a held block pushed on the free queue, no epoch bump        free queue
foreign_thread         one public mutator of the scheduler, the KV manager, the    owner
                       pool or the host tier, called from another thread (round
                       robin over all of them)
swap_corruption        one bit of a used slot of a host (swap) block that a        checksum
                       swapped-out request will bring back                         at swap-in
=====================  ==========================================================  ===========

A swap corruption alters host memory, which no step reads: it becomes live (and counts
for corrupted tokens) in the device block it is swapped into, under that block's id.
"""

from __future__ import annotations

import dataclasses
import random

from pagewarden.faults.appliers import (
    FAULT_KINDS,
    IMMEDIATE_KINDS,
    KV_ALTERING_KINDS,
    MAPPING_KINDS,
    METADATA_KINDS,
    PER_REQUEST_KINDS,
    FaultAppliers,
    InjectedFault,
)
from pagewarden.kernels.attention import AttentionMetadata
from pagewarden.kv.block import BlockState
from pagewarden.sched.output import (
    FailureKey,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from pagewarden.worker.step_hooks import StepHooks

__all__ = ["FAULT_KINDS", "FaultInjector", "InjectedFault"]


class FaultInjector(FaultAppliers, StepHooks):
    """Injects faults into ``engine`` and attributes the engine's detections to them."""

    def __init__(self, engine, seed: int = 0) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.faults: list[InjectedFault] = []
        self.corrupted_tokens = 0
        self.steps = 0
        self._pending: list[InjectedFault] = []  # applied in a later step
        self._copied: set[int] = set()
        self._written: set[int] = set()
        self._original: dict[str, ScheduledRequest] = {}
        self._view: dict[str, ScheduledRequest] = {}  # the worker's view of this step
        # Requests whose view of this step a mapping fault (table, index or slot
        # redirect) altered: one per request and step, since a second could undo the
        # first (an index redirected back to the block a table redirect moved it from)
        # or overwrite it, and the ground truth would count a fault that altered nothing.
        self._redirected: set[str] = set()
        self._stale: dict[int, tuple[str, int, int]] = {}  # fault -> (rid, block, epoch)
        self._displaced: dict[int, tuple[int, int]] = {}  # wrong ref -> (index, old block)
        self._in_host: dict[int, int] = {}  # swap fault -> host block, until swapped in
        self._foreign_next = 0  # round robin over the foreign mutators
        self._written: set[int] = set()
        engine.install_hooks(self)

    def before_execute(self, out: SchedulerOutput) -> SchedulerOutput:
        out = self._apply_step_faults(out)
        self._follow_swap_ins(out)
        return out

    def on_attention_metadata(self, out: SchedulerOutput, meta: AttentionMetadata) -> None:
        pending = [f for f in self._pending if f.kind in METADATA_KINDS]
        if not pending or out.is_empty:
            return
        reqs = list(out.requests)
        bs = self.engine.config.block_size
        self._written = {int(s) // bs for s in meta.slot_mapping.tolist()}
        for fault in pending:
            order = list(range(len(reqs)))
            self.rng.shuffle(order)
            if any(getattr(self, f"_apply_{fault.kind}")(reqs, meta, k, fault) for k in order):
                self._pending.remove(fault)
                fault.step = self.steps
                blocks = self.engine.scheduler.kv.pool.blocks
                fault.origins = {b: (blocks[b].epoch, blocks[b].block_hash) for b in fault.blocks}
                fault.live_blocks = set(fault.blocks)
                if fault.kind == "index_redirect":
                    fault.live_blocks = {-1}  # live for this call only (see _after_step)

    def on_detection(self, block_ids: set[int], key: FailureKey, req_id: str | None) -> None:
        self.mark_detected(block_ids, key, req_id=req_id)
        # A rollback to before one stale ref drops the request's later stale refs too:
        # those faults can no longer be read, before this step runs.
        self._prune_unreachable()

    def after_step(self, out: SchedulerOutput, result: ModelRunnerOutput, updates) -> None:
        self._after_step(out, result, updates)

    def mark_detected(self, blocks: set[int], key: FailureKey, req_id: str | None = None) -> None:
        """Attribute a detection (blocks named by a check) to the faults that touched them."""
        for f in self.faults:
            hit = f.blocks & blocks
            if f.kind == "use_after_free":
                hit = hit if req_id in f.req_ids or req_id is None else set()
            if not hit:
                continue
            f.live_blocks -= hit
            if f.kind in PER_REQUEST_KINDS:
                f.live_blocks.clear()
            if f.detected_step is None:
                f.detected_step = self.steps + 1 if key.found_by == "schedule" else self.steps
                f.found_by = f"{key.kind}/{key.found_by}"

    def _reads_corrupt(self, sr: ScheduledRequest) -> bool:
        bs = self.engine.config.block_size
        read = set(sr.block_table[: (sr.positions.stop + bs - 1) // bs])
        for f in self.faults:
            if not f.live_blocks:
                continue
            if f.kind in PER_REQUEST_KINDS:
                # Only the request whose view was altered reads wrong K/V.
                if sr.req_id in f.req_ids:
                    return True
            elif read & f.live_blocks:
                return True
        return False

    def _after_step(self, out: SchedulerOutput, res: ModelRunnerOutput, updates) -> None:
        self.steps += 1
        by_id = {r.req_id: r for r in out.requests}
        by_id.update((rid, sr) for rid, sr in self._view.items() if rid in by_id)
        self._view = {}
        self._redirected.clear()
        for u in updates:
            sr = by_id.get(u.req_id)
            if sr is not None and self._reads_corrupt(sr):
                self.corrupted_tokens += len(u.new_token_ids)
        for kv_fault in res.faults:
            self.mark_detected(
                set(kv_fault.block_ids), FailureKey(kv_fault.kind, kv_fault.found_by)
            )
        # A redirect lasts one step: afterwards nothing reads through it.
        for f in self.faults:
            if f.kind in ("table_redirect", "index_redirect"):
                f.live_blocks.clear()
        self._prune_unreachable()

    def settle(self) -> None:
        """Bring the ground truth up to date (call after the last step)."""
        self._prune_unreachable()

    def _prune_unreachable(self) -> None:
        """Altered blocks nobody can read any more (unreferenced and unhashed, or
        quarantined) stop counting as live; so does a stale ref that was rolled back."""
        blocks = self.engine.scheduler.kv.pool.blocks
        tables = self.engine.scheduler.kv.tables
        for f in self.faults:
            if f.kind in ("use_after_free", "coherent_wrong_ref"):
                rid, bid, epoch = self._stale[f.fault_id]
                entry = tables.get(rid)
                if entry is None or all(
                    not (r.block_id == bid and r.epoch == epoch) for r in entry.refs
                ):
                    f.live_blocks.clear()
                continue
            for b in list(f.live_blocks):
                block = blocks[b]
                epoch, block_hash = f.origins.get(b, (block.epoch, block.block_hash))
                rewritten = block.block_hash != block_hash or (
                    block_hash is None and block.epoch != epoch
                )
                unreachable = block.ref_cnt == 0 and block.block_hash is None
                if block.state is BlockState.QUARANTINED or rewritten or unreachable:
                    f.live_blocks.discard(b)

    def inject(self, kind: str) -> InjectedFault | None:
        """Inject one fault of ``kind``.

        ``use_after_free`` and ``foreign_thread`` act now, on scheduler state (None when
        no request is running). The others alter KV or the worker's view and are applied
        inside the next step that schedules a suitable target, after scheduling and
        before the worker's checks (returned record is filled in then).
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {', '.join(FAULT_KINDS)}")
        if kind in IMMEDIATE_KINDS:
            return getattr(self, f"_inject_{kind}")()
        fault = self._new(kind, set(), (), "pending: applied in the next step with a target")
        self._pending.append(fault)
        return fault

    @property
    def pending_faults(self) -> list[InjectedFault]:
        """Faults queued for a step that has not offered a target yet (not injected)."""
        return list(self._pending)

    def _apply_step_faults(self, out: SchedulerOutput) -> SchedulerOutput:
        if not any(f.kind not in METADATA_KINDS for f in self._pending) or out.is_empty:
            return out
        requests = list(out.requests)
        # Copy-on-write and swap-in destinations are overwritten by the copies at the
        # start of the step (altering them first would be erased, not a fault); a
        # swap-out source's alteration would leave with it for the host tier, which the
        # ground truth follows only for swap_corruption.
        self._copied = (
            {dst for _, dst in out.copy_blocks}
            | {w.dst for w in out.swap_in}
            | {w.src for w in out.swap_out}
        )
        bs = self.engine.config.block_size
        self._written = {slot // bs for r in out.requests for slot in r.slot_mapping}
        self._original = {r.req_id: r for r in out.requests}
        self._current = out
        still = [f for f in self._pending if f.kind in METADATA_KINDS]
        # Mapping faults first: a content fault then lands in what the worker reads.
        step_faults = [f for f in self._pending if f.kind not in METADATA_KINDS]
        mapping_first = sorted(step_faults, key=lambda f: f.kind not in MAPPING_KINDS)
        for fault in mapping_first:
            order = list(range(len(requests)))
            self.rng.shuffle(order)
            if not any(getattr(self, f"_apply_{fault.kind}")(requests, k, fault) for k in order):
                still.append(fault)
                continue
            fault.step = self.steps
            fault.live_blocks = set(fault.blocks) if fault.kind in KV_ALTERING_KINDS else set()
            blocks = self.engine.scheduler.kv.pool.blocks
            fault.origins = {b: (blocks[b].epoch, blocks[b].block_hash) for b in fault.blocks}
            if fault.kind == "table_redirect":
                fault.live_blocks = {-1}  # live for this step only (see _after_step)
        self._pending = still
        self._view = {r.req_id: r for r in requests}
        return dataclasses.replace(out, requests=requests)

    def _follow_swap_ins(self, out: SchedulerOutput) -> None:
        """A corrupted host block swapped in this step: the fault lives in its new
        device block from now on."""
        if not self._in_host:
            return
        moved = {w.src: w.dst for w in out.swap_in}
        kv = self.engine.scheduler.kv
        blocks = kv.pool.blocks
        for f in self.faults:
            host = self._in_host.get(f.fault_id)
            if host is None:
                continue
            if host not in moved:
                table = kv.swap.tables.get(f.req_ids[0])
                if table is None or host not in table.host_ids:
                    del self._in_host[f.fault_id]  # aborted while swapped: never read
                continue
            dst = moved[host]
            del self._in_host[f.fault_id]
            f.blocks, f.live_blocks = {dst}, {dst}
            f.origins = {dst: (blocks[dst].epoch, blocks[dst].block_hash)}
            f.detail += f"; swapped in to device block {dst}"
