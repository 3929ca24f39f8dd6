"""Fault injection into a live engine, with ground truth for what each fault touched.

``FaultInjector`` attaches to an ``EngineCore`` and injects one fault at a time between
steps (or, for indexing faults, into the worker's view of the next step). It watches
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

=================  =============================================================  ==========
kind               what is injected                                               caught by
=================  =============================================================  ==========
sealed_bitflip     one bit of a sealed (full, checksummed) block a request holds  checksum
open_bitflip       one bit of a written slot of a block still being filled        checksum
tag_corruption     the slot tag of a written slot                                 slot tag
table_redirect     a block-table entry, as the worker sees it, points at another  slot tag
                   live request's block for one step
slot_redirect      a slot index of the next step points into another request's    slot tag
                   block, so K/V is scattered there
use_after_free     a block a request still lists is freed and handed out again    epoch
foreign_thread     a block-pool mutation from another thread                      owner
swap_corruption    one bit of a used slot of a host (swap) block that a swapped-  checksum
                   out request will bring back                                    at swap-in
=================  =============================================================  ==========

A swap corruption alters host memory, which no step reads: it becomes live (and counts
for corrupted tokens) in the device block it is swapped into, under that block's id.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from dataclasses import dataclass, field

import torch

from pagewarden.faults.kv_faults import corrupt_tag, flip_bit, flip_slot_bit
from pagewarden.kv.block import BlockState
from pagewarden.kv.errors import KVOwnershipError
from pagewarden.sched.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

FAULT_KINDS: tuple[str, ...] = (
    "sealed_bitflip",
    "open_bitflip",
    "tag_corruption",
    "table_redirect",
    "slot_redirect",
    "use_after_free",
    "foreign_thread",
    "swap_corruption",
)
_MAPPING = frozenset({"table_redirect", "slot_redirect"})
#: Kinds whose reads return wrong K/V until detected (tag corruption changes no K/V; a
#: refused foreign mutation changes nothing).
_ALTERS_KV = frozenset(
    {
        "sealed_bitflip",
        "open_bitflip",
        "table_redirect",
        "slot_redirect",
        "use_after_free",
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


class FaultInjector:
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
        self._stale: dict[int, tuple[str, int, int]] = {}  # fault -> (rid, block, epoch)
        self._in_host: dict[int, int] = {}  # swap fault -> host block, until swapped in
        self._hook()

    # ----------------------------------------------------------------- plumbing
    def _hook(self) -> None:
        runner, scheduler = self.engine.runner, self.engine.scheduler
        execute, update, verify = runner.execute, scheduler.update, scheduler.verify_block_tables

        def hooked_execute(out: SchedulerOutput) -> ModelRunnerOutput:
            out = self._apply_step_faults(out)
            self._follow_swap_ins(out)
            return execute(out)

        def hooked_update(out: SchedulerOutput, res: ModelRunnerOutput):
            updates = update(out, res)
            self._after_step(out, res, updates)
            return updates

        def hooked_verify():
            events = verify()
            for e in events:
                self.mark_detected({e.block_id}, f"{e.kind}/schedule", req_id=e.req_id)
            if events:
                # A rollback to before one stale ref drops the request's later stale refs
                # too: those faults can no longer be read, before this step runs.
                self._prune_unreachable()
            return events

        runner.execute = hooked_execute
        scheduler.update = hooked_update
        scheduler.verify_block_tables = hooked_verify

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

    def mark_detected(self, blocks: set[int], found_by: str, req_id: str | None = None) -> None:
        """Attribute a detection (blocks named by a check) to the faults that touched them."""
        for f in self.faults:
            hit = f.blocks & blocks
            if f.kind == "use_after_free":
                hit = hit if req_id in f.req_ids or req_id is None else set()
            if not hit:
                continue
            f.live_blocks -= hit
            if f.kind in ("use_after_free", "table_redirect"):
                f.live_blocks.clear()
            if f.detected_step is None:
                f.detected_step = self.steps + 1 if found_by.endswith("/schedule") else self.steps
                f.found_by = found_by

    # ------------------------------------------------------------ ground truth
    def _reads_corrupt(self, sr: ScheduledRequest) -> bool:
        bs = self.engine.config.block_size
        read = set(sr.block_table[: (sr.positions.stop + bs - 1) // bs])
        for f in self.faults:
            if not f.live_blocks:
                continue
            if f.kind in ("use_after_free", "table_redirect"):
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
        for u in updates:
            sr = by_id.get(u.req_id)
            if sr is not None and self._reads_corrupt(sr):
                self.corrupted_tokens += len(u.new_token_ids)
        for kv_fault in res.faults:
            self.mark_detected(set(kv_fault.block_ids), f"{kv_fault.kind}/{kv_fault.found_by}")
        # A redirect lasts one step: afterwards nothing reads through it.
        for f in self.faults:
            if f.kind == "table_redirect":
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
            if f.kind == "use_after_free":
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
        if kind in ("use_after_free", "foreign_thread"):
            return getattr(self, f"_inject_{kind}")()
        fault = self._new(kind, set(), (), "pending: applied in the next step with a target")
        self._pending.append(fault)
        return fault

    @property
    def pending_faults(self) -> list[InjectedFault]:
        """Faults queued for a step that has not offered a target yet (not injected)."""
        return list(self._pending)

    def _apply_step_faults(self, out: SchedulerOutput) -> SchedulerOutput:
        if not self._pending or out.is_empty:
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
        still = []
        # Mapping faults first: a content fault then lands in what the worker reads.
        mapping_first = sorted(self._pending, key=lambda f: f.kind not in _MAPPING)
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
        fault.blocks, fault.req_ids = {old, target}, (sr.req_id,)
        fault.detail = f"{sr.req_id} table[{index}]: block {old} -> {target}"
        return True

    def _apply_slot_redirect(
        self, requests: list[ScheduledRequest], k: int, fault: InjectedFault
    ) -> bool:
        """Scatter one new token's K/V over a written slot of another running request."""
        sr = requests[k]
        if sr is not self._original[sr.req_id]:
            return False
        bs = self.engine.config.block_size
        tables = self.engine.scheduler.kv.tables
        own = set(sr.block_table)
        mine = (sr.prompt_token_ids + sr.output_token_ids)[: sr.positions.start + 1]
        # Overwriting a slot with the very same (token chain, position) alters nothing.
        victims = [
            (r, p)
            for r in self._running()
            if r.req_id != sr.req_id
            for p in range(r.num_computed_tokens)
            if tables[r.req_id].ids[p // bs] not in own
            and not (p == sr.positions.start and r.all_token_ids[: p + 1] == mine)
        ]
        if not victims:
            return False
        victim, pos = self.rng.choice(victims)
        target = tables[victim.req_id].ids[pos // bs]
        slots = list(sr.slot_mapping)
        old = slots[0]
        slots[0] = target * bs + pos % bs
        requests[k] = dataclasses.replace(sr, slot_mapping=slots)
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
        pool.free_blocks([block])  # the bug: freed while the table still lists it
        # ... and handed out again: first in line for the next allocation, content gone.
        if block.block_hash is not None:
            pool.free_queue.remove(block)
            pool._drop_hash(block)
            block.state = BlockState.FREE
            pool.free_queue.appendleft(block)
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
        pool = self.engine.scheduler.kv.pool
        before = (len(pool.free_queue), pool.num_allocations)
        outcome: list[BaseException] = []

        def mutate() -> None:
            try:
                pool.get_new_blocks(1)
            except KVOwnershipError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=mutate, name="pagewarden-chaos-foreign")
        thread.start()
        thread.join()
        fault = self._new("foreign_thread", set(), (), "get_new_blocks(1) from a foreign thread")
        if outcome and (len(pool.free_queue), pool.num_allocations) == before:
            fault.detected_step = self.steps + 1
            fault.found_by = "ownership/owner_check"
        return fault
