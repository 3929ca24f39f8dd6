"""One request's block table, and what the tables really hold against what the pool counts.

``RequestBlocks`` is the table ``KVCacheManager`` keeps per request. The two functions
below read tables against the pool's blocks without changing either: the scheduler's
table check before each step (``first_unsound_entry``) and the reference recount that
recovery and the audit repair from (``held_counts``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagewarden.kv.block import BlockHash, BlockRef, KVBlock


class RequestBlocks:
    """One request's block table: ``refs[i]`` is logical block i; ``ids`` mirrors the ids.

    ``hashes[i]`` is the chained hash of full block i, known for the first
    ``len(hashes)`` blocks (computed at lookup or seal, never twice). ``miss`` is the
    packed tokens of the block where the prefix lookup missed, ``(index, bytes)``, so
    sealing that block does not pack it again.

    ``ids`` is handed to the model runner as ``ScheduledRequest.block_table`` without a
    copy (and shared between forked children), so it is never mutated in place: every
    change assigns a new list. ``refs`` and ``hashes`` are private and grow in place.
    """

    __slots__ = ("refs", "ids", "hashes", "num_sealed", "extra_keys", "miss")

    def __init__(self, extra_keys: bytes) -> None:
        self.refs: list[BlockRef] = []
        self.ids: list[int] = []
        self.hashes: list[BlockHash] = []
        self.num_sealed = 0  # blocks [0, num_sealed) carry their hash in the pool
        self.extra_keys = extra_keys
        self.miss: tuple[int, bytes] | None = None


def first_unsound_entry(entry: RequestBlocks, blocks: Sequence[KVBlock]) -> int | None:
    """Index of ``entry``'s first table entry that no longer names a live block, or None
    (``KVCacheManager.first_unsound_block`` says when an entry is unsound)."""
    for i, (ref, bid) in enumerate(zip(entry.refs, entry.ids)):
        block = blocks[bid]
        if (
            bid != ref.block_id
            or block.epoch != ref.epoch
            or block.prev_free is not None
            or block.ref_cnt <= 0
        ):
            return i
    return None


def held_counts(tables: Iterable[RequestBlocks], blocks: Sequence[KVBlock]) -> list[int]:
    """References ``tables`` really hold, per block id: entries whose id and epoch match
    the block (a stale or altered entry holds nothing)."""
    held = [0] * len(blocks)
    for entry in tables:
        for ref, bid in zip(entry.refs, entry.ids):
            if bid == ref.block_id and 0 < bid < len(blocks):
                if blocks[bid].epoch == ref.epoch:
                    held[bid] += 1
    return held
