"""Metadata invariant checks for the block pool and the block tables over it.

Run after every operation in tests and every N steps in the engine; each violation is
a human-readable string (an empty list means the metadata is sound).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pagewarden.kv.block import RESERVED_BLOCK_ID, BlockRef, BlockState

if TYPE_CHECKING:
    from pagewarden.kv.block_pool import BlockPool


def check_invariants(pool: BlockPool, tables: Mapping[str, Sequence[BlockRef]]) -> list[str]:
    """Conservation, ref counts, free-queue membership and hash-index consistency."""
    return (
        _conservation_errors(pool)
        + _ref_count_errors(pool, tables)
        + _free_queue_errors(pool)
        + _hash_index_errors(pool)
        + _quarantine_errors(pool)
    )


def _conservation_errors(pool: BlockPool) -> list[str]:
    """Every block is in exactly one state; block 0 is the one reserved block."""
    errors: list[str] = []
    blocks = pool.blocks
    total = pool.num_blocks

    counts = pool.state_counts()
    if sum(counts.values()) != total:
        errors.append(f"conservation: states sum to {sum(counts.values())}, total is {total}")
    if (
        counts[BlockState.RESERVED] != 1
        or blocks[RESERVED_BLOCK_ID].state is not BlockState.RESERVED
    ):
        errors.append("conservation: block 0 must be the one reserved block")
    return errors


def _ref_count_errors(pool: BlockPool, tables: Mapping[str, Sequence[BlockRef]]) -> list[str]:
    """Ref counts equal the references the tables hold (each table holds one per block), and each state agrees with its block's count and hash."""
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
    for block in blocks[1:]:
        if block.ref_cnt != expected[block.block_id]:
            errors.append(
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                f"{expected[block.block_id]} references held"
            )
        state = block.state
        if state is BlockState.USED and block.ref_cnt <= 0:
            errors.append(f"block {block.block_id} is USED with ref_cnt {block.ref_cnt}")
        if state in (BlockState.FREE, BlockState.CACHED_FREE) and block.ref_cnt != 0:
            errors.append(f"block {block.block_id} is {state.name} with ref_cnt {block.ref_cnt}")
        if state is BlockState.FREE and block.block_hash is not None:
            errors.append(f"block {block.block_id} is FREE but carries a hash")
        if state is BlockState.CACHED_FREE and block.block_hash is None:
            errors.append(f"block {block.block_id} is CACHED_FREE without a hash")
        if state is BlockState.RESERVED:
            errors.append(f"block {block.block_id} is RESERVED; only block 0 may be")
        if (block.block_hash is None) != (block.token_bytes is None):
            errors.append(f"block {block.block_id}: hash and stored tokens disagree")
    return errors


def _free_queue_errors(pool: BlockPool) -> list[str]:
    """The free queue holds each ref_cnt == 0, non-quarantined block exactly once."""
    errors: list[str] = []
    blocks = pool.blocks
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
        if block.state not in (BlockState.FREE, BlockState.CACHED_FREE):
            errors.append(f"free queue holds block {block.block_id} in state {block.state.name}")
    if len(in_queue) != len(pool.free_queue):
        errors.append(f"free queue length {len(pool.free_queue)} but {len(in_queue)} linked")
    for block in blocks[1:]:
        should = block.ref_cnt == 0 and block.state is not BlockState.QUARANTINED
        if should and block.block_id not in in_queue:
            errors.append(f"block {block.block_id} has ref_cnt 0 but is not in the free queue")
    return errors


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


def _quarantine_errors(pool: BlockPool) -> list[str]:
    """The quarantine set and the blocks' states agree."""
    errors: list[str] = []
    blocks = pool.blocks
    q_states = {b.block_id for b in blocks if b.state is BlockState.QUARANTINED}
    if q_states != pool.quarantined:
        errors.append(
            f"quarantine set {sorted(pool.quarantined)} != quarantined states {sorted(q_states)}"
        )
    return errors
