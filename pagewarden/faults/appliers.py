"""How each fault kind is applied: the fault records and the injector's hands.

``FaultAppliers`` is the base of ``FaultInjector`` (``injector.py``, whose docstring
tables the kinds and the defence each exercises). Each kind has one method, found by
name: ``_apply_<kind>`` for the kinds applied inside a step to the worker's view of it
(``(requests, k, fault)``) or to its forward call's ``AttentionMetadata``
(``(requests, meta, k, fault)``), returning whether request ``k`` offered a target;
``_inject_<kind>`` for the kinds that act at once on scheduler or KV metadata, between
steps. Every applier records what it altered in an ``InjectedFault`` (``_new``), the
ground truth the injector later matches the engine's detections against.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from pagewarden.faults.foreign import call_from_thread, foreign_calls, state_fingerprint
from pagewarden.faults.kv_faults import corrupt_tag, flip_bit, flip_slot_bit
from pagewarden.faults.metadata_faults import inject_metadata_fault
from pagewarden.kernels.attention import AttentionMetadata
from pagewarden.kv.errors import KVOwnershipError
from pagewarden.sched.output import (
    ScheduledRequest,
    SchedulerOutput,
)

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
MAPPING_KINDS = frozenset({"table_redirect", "slot_redirect"})
#: Applied to the forward call's ``AttentionMetadata`` (``on_attention_metadata``).
METADATA_KINDS = frozenset({"index_redirect", "slot_mapping_redirect"})
#: Act at once on scheduler or KV metadata, between steps.
IMMEDIATE_KINDS = frozenset(
    {"use_after_free", "coherent_wrong_ref", "free_list_push", "foreign_thread"}
)
#: Only the request whose view was altered reads wrong K/V.
PER_REQUEST_KINDS = frozenset(
    {"use_after_free", "table_redirect", "index_redirect", "coherent_wrong_ref"}
)
#: Kinds whose reads return wrong K/V until detected (tag corruption changes no K/V; a
#: refused foreign mutation changes nothing).
KV_ALTERING_KINDS = frozenset(
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


class FaultAppliers:
    """The appliers of every fault kind over ``engine``'s state (see the module docstring)."""

    engine: Any
    rng: random.Random
    faults: list[InjectedFault]
    steps: int
    _copied: set[int]
    _written: set[int]
    _original: dict[str, ScheduledRequest]
    _current: SchedulerOutput
    _redirected: set[str]
    _stale: dict[int, tuple[str, int, int]]
    _displaced: dict[int, tuple[int, int]]
    _in_host: dict[int, int]
    _foreign_next: int

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
            live_blocks=set(blocks) if kind in KV_ALTERING_KINDS else set(),
        )
        self.faults.append(fault)
        return fault

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
        # Not a block written in this very step (it may take the entry's bytes before it
        # is read), nor one that reads back the entry's K/V (``_differing``).
        others = self._differing(
            [b for b in others if b not in self._written], sr.req_id, index, sr.block_table[index]
        )
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

    def _differing(self, blocks: list[int], req_id: str, index: int, current: int) -> list[int]:
        """``blocks`` a redirect of entry ``index`` of ``req_id``'s table (now ``current``)
        may target: a block with ``current``'s bytes (a sibling of n > 1 with the same
        tokens) would read back the same K/V, which alters nothing, so it is not a fault;
        nor one with the bytes of a block that a live coherent wrong ref took that entry
        away from: it undoes the wrong ref for the step (the request reads its own K/V)."""
        kept = [current]
        for f in self.faults:
            if f.kind == "coherent_wrong_ref" and f.live_blocks and f.req_ids == (req_id,):
                i, old = self._displaced[f.fault_id]
                if i == index:
                    kept.append(old)
        caches = self.engine.kv_store.caches
        return [
            b
            for b in blocks
            if not any(all(torch.equal(c[:, b], c[:, k]) for c in caches) for k in kept)
        ]

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
        others = self._differing(others, sr.req_id, index, old)
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
        self._displaced[fault.fault_id] = (index, old)
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
