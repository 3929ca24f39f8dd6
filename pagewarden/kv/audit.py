"""Metadata invariant checks for the block pool and the block tables over it.

Run after every operation in tests and every N steps in the engine; each violation is
a human-readable string (an empty list means the metadata is sound).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pagewarden.kv.block import RESERVED_BLOCK_ID, BlockRef, BlockState

_USED = BlockState.USED
_FREE = BlockState.FREE
_CACHED_FREE = BlockState.CACHED_FREE
_RESERVED = BlockState.RESERVED
_QUARANTINED = BlockState.QUARANTINED

if TYPE_CHECKING:
    from pagewarden.kv.block_pool import BlockPool


def check_invariants(pool: BlockPool, tables: Mapping[str, Sequence[BlockRef]]) -> list[str]:
    """Conservation, ref counts, free-queue membership and hash-index consistency.

    One pass over the blocks checks every per-block rule (the engine audits every
    ``audit_interval`` steps, and at one stream a pass over a pool of thousands of
    blocks is a visible share of those steps): a pass per rule took 10.1 ms on a
    2,912-block pool where this takes 1.9 ms (2-core Zen 4, load ~5).
    """
    in_queue, queue_errors = _walk_free_queue(pool)
    block_errors, reserved, q_states = _block_errors(pool, _expected_refs(pool, tables), in_queue)
    return (
        _conservation_errors(pool, reserved)
        + block_errors[0]
        + queue_errors
        + block_errors[1]
        + _hash_index_errors(pool)
        + _quarantine_errors(pool, q_states)
    )


def _conservation_errors(pool: BlockPool, reserved: int) -> list[str]:
    """Every block is in exactly one state; block 0 is the one reserved block
    (``reserved``: how many blocks are RESERVED)."""
    errors: list[str] = []
    blocks = pool.blocks
    total = pool.num_blocks
    if len(blocks) != total:
        errors.append(f"conservation: states sum to {len(blocks)}, total is {total}")
    if reserved != 1 or blocks[RESERVED_BLOCK_ID].state is not BlockState.RESERVED:
        errors.append("conservation: block 0 must be the one reserved block")
    return errors


def _expected_refs(
    pool: BlockPool, tables: Mapping[str, Sequence[BlockRef]]
) -> tuple[list[int], list[str]]:
    """The references the tables hold per block id (each table one per block), and the
    errors of the tables themselves: invalid ids, a block listed twice, stale epochs."""
    errors: list[str] = []
    blocks = pool.blocks
    total = pool.num_blocks
    expected = [0] * total
    for req_id, refs in tables.items():
        seen: set[int] = set()
        for ref in refs:
            bid = ref.block_id
            if not 0 < bid < total:
                errors.append(f"table {req_id!r} lists invalid block {bid}")
                continue
            if bid in seen:
                errors.append(f"table {req_id!r} lists block {bid} twice")
                continue
            seen.add(bid)
            expected[bid] += 1
            if blocks[bid].epoch != ref.epoch:
                errors.append(
                    f"table {req_id!r} holds stale ref to block {bid} "
                    f"(epoch {ref.epoch}, block at {blocks[bid].epoch})"
                )
    return expected, errors


def _block_errors(
    pool: BlockPool, expected_refs: tuple[list[int], list[str]], in_queue: set[int]
) -> tuple[tuple[list[str], list[str]], int, set[int]]:
    """Each block's ref count equals the references held, its state agrees with its
    count and hash, and a block with no reference that is not quarantined is on the free
    queue. Returns ((ref-count errors, free-queue errors), RESERVED blocks, the ids of
    QUARANTINED blocks)."""
    expected, errors = expected_refs
    missing: list[str] = []
    q_states: set[int] = set()
    blocks = pool.blocks
    reserved = int(blocks[RESERVED_BLOCK_ID].state is _RESERVED)
    for block in blocks[1:]:
        bid, ref_cnt, state = block.block_id, block.ref_cnt, block.state
        if ref_cnt != expected[bid]:
            errors.append(f"block {bid}: ref_cnt {ref_cnt} but {expected[bid]} references held")
        if state is _USED:
            if ref_cnt <= 0:
                errors.append(f"block {bid} is USED with ref_cnt {ref_cnt}")
        elif state is _FREE or state is _CACHED_FREE:
            if ref_cnt != 0:
                errors.append(f"block {bid} is {state.name} with ref_cnt {ref_cnt}")
            if state is _FREE and block.block_hash is not None:
                errors.append(f"block {bid} is FREE but carries a hash")
            if state is _CACHED_FREE and block.block_hash is None:
                errors.append(f"block {bid} is CACHED_FREE without a hash")
        elif state is _RESERVED:
            reserved += 1
            errors.append(f"block {bid} is RESERVED; only block 0 may be")
        elif state is _QUARANTINED:
            q_states.add(bid)
        if (block.block_hash is None) != (block.token_bytes is None):
            errors.append(f"block {bid}: hash and stored tokens disagree")
        if ref_cnt == 0 and state is not _QUARANTINED and bid not in in_queue:
            missing.append(f"block {bid} has ref_cnt 0 but is not in the free queue")
    return (errors, missing), reserved, q_states


def _walk_free_queue(pool: BlockPool) -> tuple[set[int], list[str]]:
    """The ids linked in the free queue, and its errors: broken back links, a block
    linked twice, a linked block not FREE or CACHED_FREE, a length that disagrees."""
    errors: list[str] = []
    in_queue: set[int] = set()
    prev = pool.free_queue._head
    for block in pool.free_queue:
        if block.prev_free is not prev:
            errors.append(f"free queue: broken back link at block {block.block_id}")
        prev = block
        if block.block_id in in_queue:
            errors.append(f"free queue holds block {block.block_id} twice")
            break
        in_queue.add(block.block_id)
        if block.state is not _FREE and block.state is not _CACHED_FREE:
            errors.append(f"free queue holds block {block.block_id} in state {block.state.name}")
    if len(in_queue) != len(pool.free_queue):
        errors.append(f"free queue length {len(pool.free_queue)} but {len(in_queue)} linked")
    return in_queue, errors


def _hash_index_errors(pool: BlockPool) -> list[str]:
    """Every hash index entry points at a block carrying that hash, never a quarantined one."""
    errors: list[str] = []
    for h, block in pool.hash_index.items():
        if block.block_hash != h:
            errors.append(
                f"hash index entry {h.hex()[:12]} points at block {block.block_id} with another hash"
            )
        if block.state is BlockState.QUARANTINED:
            errors.append(f"hash index points at quarantined block {block.block_id}")
    return errors


def _quarantine_errors(pool: BlockPool, q_states: set[int]) -> list[str]:
    """The quarantine set and the blocks' states agree (``q_states``: the ids of the
    QUARANTINED blocks)."""
    errors: list[str] = []
    if q_states != pool.quarantined:
        errors.append(
            f"quarantine set {sorted(pool.quarantined)} != quarantined states {sorted(q_states)}"
        )
    return errors
