"""Metadata faults: the scheduler/KV metadata changes a fault injector makes, as plain
functions (no torch) that journal themselves.

A fault injected between steps changes block tables or the pool behind the scheduler's
back, the way a bug would. For the flight recorder to replay such a run, the change is
written to the scheduler's journal as an ``("external", name, args)`` entry, and
``pagewarden replay`` applies the same function from ``METADATA_FAULTS``. A metadata
change that nobody journals (a real bug) is what replay reports as a divergence.
"""

from __future__ import annotations

from collections.abc import Callable

from pagewarden.kv.block import BlockRef, BlockState
from pagewarden.sched.scheduler import Scheduler


def free_under_table(sched: Scheduler, block_id: int) -> None:
    """Free a block a table still lists and put it first in line for the next
    allocation, hash dropped (use after free)."""
    pool = sched.kv.pool
    block = pool.blocks[block_id]
    pool.free_blocks([block])
    if block.block_hash is not None:
        pool.free_queue.remove(block)
        pool._drop_hash(block)
        block.state = BlockState.FREE
        pool.free_queue.appendleft(block)


def rewrite_table_entry(sched: Scheduler, req_id: str, index: int, target: int) -> None:
    """Rewrite entry ``index`` of ``req_id``'s table to a current ``BlockRef`` of block
    ``target`` (refs and ids agree: a coherent wrong reference)."""
    kv = sched.kv
    entry = kv.tables[req_id]
    entry.refs[index] = BlockRef(target, kv.pool.blocks[target].epoch)
    ids = list(entry.ids)
    ids[index] = target
    entry.ids = ids


def push_on_free_queue(sched: Scheduler, block_id: int) -> None:
    """Link a held block at the head of the free queue; ref_cnt, state, epoch untouched."""
    pool = sched.kv.pool
    pool.free_queue.appendleft(pool.blocks[block_id])


#: What ``pagewarden replay`` may apply for an ``external`` journal entry, by name.
METADATA_FAULTS: dict[str, Callable[..., None]] = {
    "use_after_free": free_under_table,
    "coherent_wrong_ref": rewrite_table_entry,
    "free_list_push": push_on_free_queue,
}


def inject_metadata_fault(sched: Scheduler, name: str, *args: int | str) -> None:
    """Apply ``METADATA_FAULTS[name]`` and journal it, if the scheduler is recorded."""
    METADATA_FAULTS[name](sched, *args)
    if sched.journal is not None:
        sched.journal.append(("external", name, args))
