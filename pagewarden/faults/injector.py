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
from dataclasses import dataclass, field

import torch

from pagewarden.faults.foreign import call_from_thread, foreign_calls, state_fingerprint
from pagewarden.faults.kv_faults import corrupt_tag, flip_bit, flip_slot_bit
from pagewarden.faults.metadata_faults import inject_metadata_fault
from pagewarden.kernels.attention import AttentionMetadata
from pagewarden.kv.block import BlockState
from pagewarden.kv.errors import KVOwnershipError
from pagewarden.sched.output import (
    FailureKey,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from pagewarden.worker.step_hooks import StepHooks

FAULT_KINDS: tuple[str, ...] = (
    "sealed_bitflip",
    "open_bitflip",
    "tag_corruption",
    "table_redirect",
    "slot_redirect",
    "index_redirect",
    "slot_mapping_redirect",
    "use_after_free",
    "coherent_wrong_ref",
    "free_list_push",
    "foreign_thread",
    "swap_corruption",
)
_MAPPING = frozenset({"table_redirect", "slot_redirect"})
#: Applied to the forward call's ``AttentionMetadata`` (``on_attention_metadata``).
_METADATA = frozenset({"index_redirect", "slot_mapping_redirect"})
#: Act at once on scheduler or KV metadata, between steps.
_IMMEDIATE = frozenset({"use_after_free", "coherent_wrong_ref", "free_list_push", "foreign_thread"})
#: Only the request whose view was altered reads wrong K/V.
_PER_REQUEST = frozenset(
    {"use_after_free", "table_redirect", "index_redirect", "coherent_wrong_ref"}
)
#: Kinds whose reads return wrong K/V until detected (tag corruption changes no K/V; a
#: refused foreign mutation changes nothing).
_ALTERS_KV = frozenset(
    {
        "sealed_bitflip",
        "open_bitflip",
        "table_redirect",
        "slot_redirect",
        "index_redirect",
        "slot_mapping_redirect",
        "use_after_free",
        "coherent_wrong_ref",
        "swap_corruption",
    }
)


@dataclass
class InjectedFault:
    """One injected fault and what became of it."""

    fault_id: int
    kind: str
    step: int  # engine steps completed when it was injected
    blocks: set[int]  # physical blocks it altered or misdirected to
    req_ids: tuple[str, ...]  # requests whose view it altered (mapping faults)
    detail: str
    detected_step: int | None = None
    found_by: str | None = None
    live_blocks: set[int] = field(default_factory=set)  # altered and still reachable
    # block -> (epoch, hash) when altered: a block whose hash changed, or that was freed
    # without one, was handed out again and rewritten, which erased the alteration.
    origins: dict[int, tuple] = field(default_factory=dict)

    @property
    def detected(self) -> bool:
        return self.detected_step is not None

    @property
    def delay(self) -> int | None:
        """Steps from injection to detection (0: found by the very next step)."""
        return None if self.detected_step is None else self.detected_step - self.step - 1


class FaultInjector(StepHooks):
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
        self._in_host: dict[int, int] = {}  # swap fault -> host block, until swapped in
        self._foreign_next = 0  # round robin over the foreign mutators
        self._written: set[int] = set()
        engine.install_hooks(self)

    # ----------------------------------------------------------------- plumbing
    def before_execute(self, out: SchedulerOutput) -> SchedulerOutput:
        out = self._apply_step_faults(out)
        self._follow_swap_ins(out)
        return out

    def on_attention_metadata(self, out: SchedulerOutput, meta: AttentionMetadata) -> None:
        pending = [f for f in self._pending if f.kind in _METADATA]
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

    def _running(self):
        sched = self.engine.scheduler
        return [r for r in sched.running if r.req_id in sched.kv.tables]

    def _new(
        self, kind: str, blocks: set[int], req_ids: tuple[str, ...], detail: str
    ) -> InjectedFault:
        fault = InjectedFault(
            len(self.faults),
            kind,
            self.steps,
            set(blocks),
            req_ids,
            detail,
            live_blocks=set(blocks) if kind in _ALTERS_KV else set(),
        )
        self.faults.append(fault)
        return fault

    def mark_detected(self, blocks: set[int], key: FailureKey, req_id: str | None = None) -> None:
        """Attribute a detection (blocks named by a check) to the faults that touched them."""
        for f in self.faults:
            hit = f.blocks & blocks
            if f.kind == "use_after_free":
                hit = hit if req_id in f.req_ids or req_id is None else set()
            if not hit:
                continue
            f.live_blocks -= hit
            if f.kind in _PER_REQUEST:
                f.live_blocks.clear()
            if f.detected_step is None:
                f.detected_step = self.steps + 1 if key.found_by == "schedule" else self.steps
                f.found_by = f"{key.kind}/{key.found_by}"

    # ------------------------------------------------------------ ground truth
    def _reads_corrupt(self, sr: ScheduledRequest) -> bool:
        bs = self.engine.config.block_size
        read = set(sr.block_table[: (sr.positions.stop + bs - 1) // bs])
        for f in self.faults:
            if not f.live_blocks:
                continue
            if f.kind in _PER_REQUEST:
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

    # --------------------------------------------------------------- inject
    def inject(self, kind: str) -> InjectedFault | None:
        """Inject one fault of ``kind``.

        ``use_after_free`` and ``foreign_thread`` act now, on scheduler state (None when
        no request is running). The others alter KV or the worker's view and are applied
        inside the next step that schedules a suitable target, after scheduling and
        before the worker's checks (returned record is filled in then).
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {', '.join(FAULT_KINDS)}")
        if kind in _IMMEDIATE:
            return getattr(self, f"_inject_{kind}")()
        fault = self._new(kind, set(), (), "pending: applied in the next step with a target")
        self._pending.append(fault)
        return fault

    @property
    def pending_faults(self) -> list[InjectedFault]:
        """Faults queued for a step that has not offered a target yet (not injected)."""
        return list(self._pending)

    def _apply_step_faults(self, out: SchedulerOutput) -> SchedulerOutput:
        if not any(f.kind not in _METADATA for f in self._pending) or out.is_empty:
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
        still = [f for f in self._pending if f.kind in _METADATA]
        # Mapping faults first: a content fault then lands in what the worker reads.
        step_faults = [f for f in self._pending if f.kind not in _METADATA]
        mapping_first = sorted(step_faults, key=lambda f: f.kind not in _MAPPING)
        for fault in mapping_first:
            order = list(range(len(requests)))
            self.rng.shuffle(order)
            if not any(getattr(self, f"_apply_{fault.kind}")(requests, k, fault) for k in order):
                still.append(fault)
                continue
            fault.step = self.steps
            fault.live_blocks = set(fault.blocks) if fault.kind in _ALTERS_KV else set()
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

    def _apply_swap_corruption(
        self, requests: list[ScheduledRequest], k: int, fault: InjectedFault
    ) -> bool:
        store = self.engine.kv_store
        swap = self.engine.scheduler.kv.swap
        out = self._current
        # Host blocks being written by this step's swap-outs get their bytes only when
        # the step runs: a flip now would be overwritten, not a fault.
        filling = {w.dst for w in out.swap_out}
        bs = self.engine.config.block_size
        used = [
            (h, min(bs, t.num_tokens - i * bs))
            for rid, t in swap.tables.items()
            for i, h in enumerate(t.host_ids)
            if h not in filling
        ]
        if not used or not store.host_caches:
            return False
        host, num_slots = self.rng.choice(used)
        slot = host * bs + self.rng.randrange(num_slots)
        caches = store.host_caches
        flip = flip_slot_bit(caches, slot, self.rng.randrange(len(caches)), self.rng)
        owner = next(rid for rid, t in swap.tables.items() if host in t.host_ids)
        self._in_host[fault.fault_id] = host
        fault.blocks, fault.req_ids = set(), (owner,)
        fault.detail = f"host block {host} of swapped-out {owner}: {flip!r}"
        return True

    def _apply_sealed_bitflip(
        self, requests: list[ScheduledRequest], k: int, fault: InjectedFault
    ) -> bool:
        sr = requests[k]
        guard = self.engine.runner.guard
        full = sr.block_table[: sr.positions.start // self.engine.config.block_size]
        candidates = [
            b
            for b in full
            if (not guard.sums_on or bool(guard.sealed[b])) and b not in self._copied
        ]
        if not candidates:
            return False
        block = self.rng.choice(candidates)
        caches = self.engine.kv_store.caches
        flip = flip_bit(caches, block, self.rng.randrange(len(caches)), self.rng)
        fault.blocks, fault.req_ids, fault.detail = {block}, (sr.req_id,), repr(flip)
        return True

    def _apply_open_bitflip(
        self, requests: list[ScheduledRequest], k: int, fault: InjectedFault
    ) -> bool:
        sr = requests[k]
        bs = self.engine.config.block_size
        written = sr.positions.start % bs
        if not written:
            return False
        block = sr.block_table[sr.positions.start // bs]
        if block in self._copied:
            return False
        slot = block * bs + self.rng.randrange(written)
        caches = self.engine.kv_store.caches
        flip = flip_slot_bit(caches, slot, self.rng.randrange(len(caches)), self.rng)
        fault.blocks, fault.req_ids, fault.detail = {block}, (sr.req_id,), repr(flip)
        return True

    def _apply_tag_corruption(
        self, requests: list[ScheduledRequest], k: int, fault: InjectedFault
    ) -> bool:
        sr = requests[k]
        bs = self.engine.config.block_size
        if sr.positions.start == 0:
            return False
        pos = self.rng.randrange(sr.positions.start)
        block = sr.block_table[pos // bs]
        if block in self._copied:
            return False
        change = corrupt_tag(self.engine.runner.guard.tags, block, pos % bs)
        fault.blocks, fault.req_ids, fault.detail = {block}, (sr.req_id,), repr(change)
        return True

    def _other_live_blocks(self, sr: ScheduledRequest) -> list[int]:
        """Blocks of other running requests that ``sr`` does not list."""
        own = set(sr.block_table)
        tables = self.engine.scheduler.kv.tables
        return sorted(
            {b for rid, e in tables.items() if rid != sr.req_id for b in e.ids if b not in own}
        )

    def _apply_table_redirect(
        self, requests: list[ScheduledRequest], k: int, fault: InjectedFault
    ) -> bool:
        sr = requests[k]
        n_ctx = sr.positions.start // self.engine.config.block_size
        others = self._other_live_blocks(sr)
        if n_ctx == 0 or not others or sr is not self._original[sr.req_id]:
            return False  # one mapping fault per request and step keeps truth simple
        index = self.rng.randrange(n_ctx)
        caches = self.engine.kv_store.caches
        # A block with the same bytes (a sibling of n > 1 with the same tokens) would
        # read back correct K/V: that redirect alters nothing, so it is not a fault.
        # Nor would one rewritten with those bytes in this very step, before it is read.
        others = [
            b
            for b in others
            if b not in self._written
            and not all(torch.equal(c[:, b], c[:, sr.block_table[index]]) for c in caches)
        ]
        if not others:
            return False
        target = self.rng.choice(others)
        table = list(sr.block_table)
        old, table[index] = table[index], target
        requests[k] = dataclasses.replace(sr, block_table=table)
        self._redirected.add(sr.req_id)
        fault.blocks, fault.req_ids = {old, target}, (sr.req_id,)
        fault.detail = f"{sr.req_id} table[{index}]: block {old} -> {target}"
        return True

    def _written_slot_elsewhere(self, sr: ScheduledRequest):
        """A random written position of another running request, outside ``sr``'s blocks,
        as (request, position, its block id); None when there is none. Overwriting a slot
        with the very same (token chain, position) alters nothing, so those are skipped."""
        bs = self.engine.config.block_size
        tables = self.engine.scheduler.kv.tables
        own = set(sr.block_table)
        mine = (sr.prompt_token_ids + sr.output_token_ids)[: sr.positions.start + 1]
        victims = [
            (r, p)
            for r in self._running()
            if r.req_id != sr.req_id
            for p in range(r.num_computed_tokens)
            if tables[r.req_id].ids[p // bs] not in own
            and not (p == sr.positions.start and r.all_token_ids[: p + 1] == mine)
        ]
        if not victims:
            return None
        victim, pos = self.rng.choice(victims)
        return victim, pos, tables[victim.req_id].ids[pos // bs]

    def _apply_slot_redirect(
        self, requests: list[ScheduledRequest], k: int, fault: InjectedFault
    ) -> bool:
        """Scatter one new token's K/V over a written slot of another running request."""
        sr = requests[k]
        if sr is not self._original[sr.req_id]:
            return False
        picked = self._written_slot_elsewhere(sr)
        if picked is None:
            return False
        victim, pos, target = picked
        bs = self.engine.config.block_size
        slots = list(sr.slot_mapping)
        old = slots[0]
        slots[0] = target * bs + pos % bs
        requests[k] = dataclasses.replace(sr, slot_mapping=slots)
        self._redirected.add(sr.req_id)
        fault.blocks, fault.req_ids = {old // bs, target}, (sr.req_id,)
        fault.detail = (
            f"{sr.req_id} position {sr.positions.start}: slot {old} -> "
            f"{slots[0]} ({victim.req_id} position {pos})"
        )
        return True

    def _inject_use_after_free(self) -> InjectedFault | None:
        kv = self.engine.scheduler.kv
        pool = kv.pool
        candidates = [
            (r, i, b)
            for r in self._running()
            for i, b in enumerate(kv.tables[r.req_id].ids)
            if pool.blocks[b].ref_cnt == 1
        ]
        if not candidates:
            return None
        req, index, block_id = self.rng.choice(candidates)
        block = pool.blocks[block_id]
        epoch = block.epoch
        # The bug: freed while the table still lists it, and handed out again: first in
        # line for the next allocation, content gone.
        inject_metadata_fault(self.engine.scheduler, "use_after_free", block_id)
        for cache in self.engine.kv_store.caches:
            cache[:, block_id] = torch.randn_like(cache[:, block_id])
        fault = self._new(
            "use_after_free",
            {block_id},
            (req.req_id,),
            f"block {block_id} (index {index} of {req.req_id}) freed and reused",
        )
        self._stale[fault.fault_id] = (req.req_id, block_id, epoch)
        return fault

    def _inject_foreign_thread(self) -> InjectedFault | None:
        """Call the next public mutator (round robin) from another thread; detected when
        it raised ``KVOwnershipError`` and left every piece of state as it was."""
        scheduler = self.engine.scheduler
        calls = foreign_calls(scheduler)
        call = calls[self._foreign_next % len(calls)]
        self._foreign_next += 1
        before = state_fingerprint(scheduler)
        error = call_from_thread(call.fn)
        fault = self._new(
            "foreign_thread", set(), (), f"{call.owner}.{call.method} from a foreign thread"
        )
        if isinstance(error, KVOwnershipError) and state_fingerprint(scheduler) == before:
            fault.detected_step = self.steps + 1
            fault.found_by = "ownership/owner_check"
        else:
            fault.detail += f": NOT refused cleanly ({error!r})"
        return fault

    # ------------------------------------------------------------ new kinds
    def _apply_index_redirect(
        self, reqs: list[ScheduledRequest], meta: AttentionMetadata, k: int, fault: InjectedFault
    ) -> bool:
        """Point one entry of the forward call's ``block_index`` (nothing else) at another
        live request's block with different content."""
        sr = reqs[k]
        if sr.req_id in self._redirected:
            return False
        bs = self.engine.config.block_size
        n_read = sr.positions.start // bs  # full context blocks (not written this call)
        others = [b for b in self._other_live_blocks(sr) if b not in self._written]
        if n_read == 0 or not others:
            return False
        index = self.rng.randrange(n_read)
        row = k * meta.max_blocks + index
        old = int(meta.block_index[row])
        caches = self.engine.kv_store.caches
        others = [b for b in others if not all(torch.equal(c[:, b], c[:, old]) for c in caches)]
        if not others:
            return False
        target = self.rng.choice(others)
        block_index = meta.block_index.clone()
        block_index[row] = target
        meta.block_index = block_index
        self._redirected.add(sr.req_id)
        fault.blocks, fault.req_ids = {old, target}, (sr.req_id,)
        fault.detail = f"{sr.req_id} block_index[{index}]: block {old} -> {target}"
        return True

    def _apply_slot_mapping_redirect(
        self, reqs: list[ScheduledRequest], meta: AttentionMetadata, k: int, fault: InjectedFault
    ) -> bool:
        """Point one entry of the forward call's ``slot_mapping`` (nothing else) at a
        written slot of another running request."""
        sr = reqs[k]
        if sr.req_id in self._redirected:
            return False
        picked = self._written_slot_elsewhere(sr)
        if picked is None:
            return False
        victim, pos, target = picked
        bs = self.engine.config.block_size
        t = sum(len(r.positions) for r in reqs[:k])  # the request's first new token
        slot_mapping = meta.slot_mapping.clone()
        old = int(slot_mapping[t])
        slot_mapping[t] = target * bs + pos % bs
        meta.slot_mapping = slot_mapping
        self._redirected.add(sr.req_id)
        fault.blocks, fault.req_ids = {old // bs, target}, (sr.req_id,)
        fault.detail = (
            f"{sr.req_id} position {sr.positions.start}: slot_mapping {old} -> "
            f"{target * bs + pos % bs} ({victim.req_id} position {pos})"
        )
        return True

    def _inject_coherent_wrong_ref(self) -> InjectedFault | None:
        """Rewrite a computed table entry to a valid ``BlockRef`` of another running
        request's block (refs and ids agree, the epoch is current)."""
        kv = self.engine.scheduler.kv
        blocks = kv.pool.blocks
        bs = self.engine.config.block_size
        caches = self.engine.kv_store.caches
        tags = self.engine.runner.guard.tags.tags  # (num_blocks, block_size)
        candidates = []
        # One open wrong ref per request: a second one could point the entry back at
        # the block the first took it from, which undoes the fault.
        self._prune_unreachable()
        open_refs = {
            self._stale[f.fault_id][0]
            for f in self.faults
            if f.kind == "coherent_wrong_ref" and f.live_blocks
        }
        for r in self._running():
            if r.req_id in open_refs:
                continue
            own = kv.tables[r.req_id].ids
            full = r.num_computed_tokens // bs
            others = [b for b in self._other_live_blocks_of(r.req_id) if b not in own]
            for i in range(full):
                for b in others:
                    # A block of the same token chain (the same tags in every slot it
                    # has written; its owner may be about to write the rest with the
                    # same tokens) is interchangeable, as the prefix cache would share
                    # it: pointing there alters nothing a read could be blamed for.
                    written = tags[b] != 0
                    if torch.equal(tags[b][written], tags[own[i]][written]):
                        continue
                    if not all(torch.equal(c[:, b], c[:, own[i]]) for c in caches):
                        candidates.append((r, i, b))
        if not candidates:
            return None
        req, index, target = self.rng.choice(candidates)
        old = kv.tables[req.req_id].ids[index]
        inject_metadata_fault(
            self.engine.scheduler, "coherent_wrong_ref", req.req_id, index, target
        )
        fault = self._new(
            "coherent_wrong_ref",
            {old, target},
            (req.req_id,),
            f"{req.req_id} table[{index}]: BlockRef({old}) -> BlockRef({target}) (coherent)",
        )
        self._stale[fault.fault_id] = (req.req_id, target, blocks[target].epoch)
        return fault

    def _other_live_blocks_of(self, req_id: str) -> list[int]:
        tables = self.engine.scheduler.kv.tables
        return sorted({b for rid, e in tables.items() if rid != req_id for b in e.ids})

    def _inject_free_list_push(self) -> InjectedFault | None:
        """Link a held block at the head of the free queue (next to be handed out),
        leaving its ref_cnt, state and epoch alone."""
        kv = self.engine.scheduler.kv
        pool = kv.pool
        candidates = sorted(
            {
                b
                for r in self._running()
                for b in kv.tables[r.req_id].ids
                if pool.blocks[b].ref_cnt > 0 and pool.blocks[b].prev_free is None
            }
        )
        if not candidates:
            return None
        block_id = self.rng.choice(candidates)
        inject_metadata_fault(self.engine.scheduler, "free_list_push", block_id)
        holders = tuple(sorted(kv.holders({block_id})))
        return self._new(
            "free_list_push", {block_id}, holders, f"held block {block_id} pushed on the free queue"
        )
