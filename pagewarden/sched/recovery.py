"""Integrity recovery on the scheduler's side: roll requests back to before a bad block.

KV is a pure function of the tokens, so a request whose KV is suspect recomputes it from
the start of the first suspect block and produces what it would have without the fault.

- ``verify_block_tables`` (before ``schedule``): a table entry whose epoch-tagged ref no
  longer matches its block (the block was freed under it: use after free), or whose id
  disagrees with its ref (an altered entry), rolls its request back.
  A held block found on the free queue is taken off it (nothing to recompute).
- ``recover`` (after a step whose worker checks failed): the failed blocks are
  quarantined (their prefix-cache entries go with them) and every request holding one
  rolls back; a request that no longer fits the healthy blocks fails. Reference counts
  and the free queue are then rebuilt from what the tables hold, so no fault leaks.
- ``repair`` (after a failed invariant audit): blocks held by more tables than they
  count are quarantined and their holders roll back, then the same rebuild.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagewarden.sched.admission import max_kv_blocks
from pagewarden.sched.output import KVFault, TableFaultKind
from pagewarden.sched.request import Request, RequestStatus
from pagewarden.sched.state import SchedulerState


@dataclass(frozen=True, slots=True)
class IntegrityEvent:
    """A metadata fault the scheduler caught before the step that would read it."""

    kind: TableFaultKind
    req_id: str
    block_id: int
    position: int  # the request recomputes from here


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What ``recover`` did."""

    quarantined: tuple[int, ...]
    rolled_back: dict[str, int]  # req_id -> position it recomputes from
    recomputed_tokens: int  # computed tokens thrown away
    # Requests that cannot be served any more, by top-level id (a child's parent id).
    failed: tuple[str, ...] = ()

    @property
    def unrecoverable(self) -> bool:
        return bool(self.failed)


def verify_block_tables(sched: SchedulerState) -> list[IntegrityEvent]:
    """Roll back every running request whose table names a freed or altered block; take
    held blocks off the free queue."""
    kv = sched.kv
    bs = sched.config.block_size
    blocks = kv.pool.blocks
    events: list[IntegrityEvent] = []
    for req in sched.running:
        while (index := kv.first_unsound_block(req.req_id)) is not None:
            entry = kv.tables[req.req_id]
            ref = entry.refs[index]
            kind: TableFaultKind
            if entry.ids[index] != ref.block_id:
                kind = "table_mismatch"
            elif blocks[ref.block_id].epoch != ref.epoch:
                kind = "stale_ref"
            else:
                # Held, yet on the free queue (or counted free): nothing was handed out
                # yet (allocation comes after this check), so the K/V is intact. Take it
                # off the queue; the request keeps its progress.
                kv.reconcile()
                position = req.num_computed_tokens
                events.append(IntegrityEvent("free_list", req.req_id, ref.block_id, position))
                continue
            events.append(IntegrityEvent(kind, req.req_id, ref.block_id, index * bs))
            roll_back(sched, req, index * bs)
            break
    if events:
        # As in recover(): a rolled-back entry that named another block than its own
        # (a coherent wrong ref, then freed under the table) dropped nothing, so its own
        # block is still counted; count the references the tables really hold.
        kv.reconcile()
    return events


def recover(sched: SchedulerState, faults: list[KVFault]) -> RecoveryReport:
    """Quarantine the failed blocks and roll back every request that holds one.

    Each request recomputes from the start of the first failed block in its table (or
    the rollback position a fault names, if earlier).
    """
    bs = sched.config.block_size
    bad = {b for f in faults for b in f.block_ids if b != 0}
    targets: dict[str, int] = {}
    for f in faults:
        for rid, pos in f.rollback.items():
            targets[rid] = min(targets.get(rid, pos), pos)
    for rid, index in sched.kv.holders(bad).items():
        targets[rid] = min(targets.get(rid, index * bs), index * bs)
    for block_id in sorted(bad):
        sched.kv.pool.quarantine(block_id)
    rolled_back: dict[str, int] = {}
    recomputed = 0
    for rid, pos in targets.items():
        req = sched.requests.get(rid)
        if req is None or req.status is not RequestStatus.RUNNING:
            continue
        before = req.num_computed_tokens
        rolled_back[rid] = roll_back(sched, req, pos)
        recomputed += before - rolled_back[rid]
    failed = _fail_unservable(sched, rolled_back)
    # Rollbacks free by the entries the tables hold; an entry that named another
    # request's block freed that block, not its own. Counting the references the tables
    # really hold frees whatever is left over, so no fault leaks a block.
    sched.kv.reconcile()
    return RecoveryReport(tuple(sorted(bad)), rolled_back, recomputed, failed)


def repair(sched: SchedulerState) -> RecoveryReport:
    """Recover from metadata an invariant audit found inconsistent.

    Blocks more tables hold than their ref_cnt counts are quarantined and every holder
    rolls back to before them (any of them may have overwritten the others' K/V); then
    ref counts and the free queue are rebuilt from the references the tables really hold
    (leaked references freed, held blocks off the free queue).
    """
    over = sched.kv.overshared_blocks()
    detail = "blocks held by more tables than their reference count"
    return recover(sched, [KVFault("refcount", tuple(over), {}, "audit", detail)])


def roll_back(sched: SchedulerState, req: Request, position: int) -> int:
    """Forget ``req``'s computed tokens from the block holding ``position`` on; returns
    the block-aligned position it recomputes from."""
    bs = sched.config.block_size
    keep = min(req.num_computed_tokens, position) // bs
    req.num_computed_tokens = keep * bs
    sched.kv.truncate(req.req_id, keep)
    return keep * bs


def _fail_unservable(sched: SchedulerState, req_ids: Iterable[str]) -> tuple[str, ...]:
    """Abort requests that can no longer fit in the pool's healthy blocks; returns their
    top-level ids."""
    healthy = sched.usable_blocks()
    bs = sched.config.block_size
    failed: list[str] = []
    top_ids: set[str] = set()
    for rid in req_ids:
        req = sched.requests[rid]
        if max_kv_blocks(req.num_prompt_tokens, req.max_tokens, bs) > healthy:
            failed.append(rid)
            top_ids.add(req.parent_id if req.parent_id is not None else rid)
    if failed:
        sched._finish_unjournaled(failed, RequestStatus.FINISHED_ABORTED, "error")
    return tuple(sorted(top_ids))


def quarantined_block_ids(sched: SchedulerState) -> list[int]:
    """Quarantined blocks nobody holds any more and that are not retired: ready to be
    scrubbed, re-verified and released."""
    pool = sched.kv.pool
    return sorted(
        b for b in pool.quarantined if pool.blocks[b].ref_cnt == 0 and b not in pool.retired
    )
