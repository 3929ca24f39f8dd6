"""The block pool: free queue, hash index for prefix caching, quarantine.

Invariant: every block except block 0 is in exactly one of
FREE (in queue, no hash), CACHED_FREE (in queue, hashed, evictable), USED (ref_cnt > 0),
QUARANTINED (out of the queue and the hash index; ref_cnt may still be > 0 until the
holders free it). ``audit.check_invariants`` verifies this.

Ownership: once ``claim_ownership()`` has named a thread, every mutating method raises
``KVOwnershipError`` (and counts it) when called from any other thread, before it
changes anything.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from pagewarden.kv.block import RESERVED_BLOCK_ID, BlockHash, BlockId, BlockState, KVBlock
from pagewarden.kv.cache_events import BlockRemoved, BlockStored, CacheEvent
from pagewarden.kv.errors import (
    BlockPoolExhausted,
    BlockStateError,
    KVOwnershipError,
    QuarantinedBlockError,
)
from pagewarden.kv.free_queue import FreeBlockQueue
from pagewarden.kv.prefix_hash import pack_block_tokens

_FREE = BlockState.FREE
_USED = BlockState.USED
_CACHED_FREE = BlockState.CACHED_FREE
_QUARANTINED = BlockState.QUARANTINED

#: A block quarantined this many times is retired: it never returns to service.
MAX_BLOCK_FAILURES = 3


class BlockTrace:
    """The blocks a pool handed out (``allocated``) and returned to the free state
    (``freed``: the last reference dropped, epoch bumped), in order, while attached as
    ``BlockPool.trace``; the flight recorder keeps one per engine step."""

    __slots__ = ("allocated", "freed")

    def __init__(self) -> None:
        self.allocated: list[int] = []
        self.freed: list[int] = []


class EvictedBlock(NamedTuple):
    """A sealed, prefix-cached block the allocator just evicted: its K/V bytes are intact
    until the step it was handed out for writes it."""

    block_id: int
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_bytes: bytes


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` slots; block 0 reserved, never handed out."""

    __slots__ = (
        "num_blocks",
        "block_size",
        "blocks",
        "free_queue",
        "hash_index",
        "quarantined",
        "num_allocations",
        "num_frees",
        "num_evictions",
        "owner_thread",
        "ownership_violations",
        "failure_counts",
        "retired",
        "held_blocks_skipped",
        "held_blocks_found_at_free",
        "cache_events",
        "trace",
        "evicted",
        "dead",
    )

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.blocks[RESERVED_BLOCK_ID].state = BlockState.RESERVED
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.hash_index: dict[BlockHash, KVBlock] = {}
        self.quarantined: set[BlockId] = set()
        self.num_allocations = 0
        self.num_frees = 0
        self.num_evictions = 0
        self.owner_thread: int | None = None
        self.ownership_violations = 0
        # block id -> checks it failed; a block failing MAX_BLOCK_FAILURES times is retired
        # (stays quarantined for good, like a remapped bad sector).
        self.failure_counts: dict[int, int] = {}
        self.retired: set[BlockId] = set()
        # Held blocks found on the free queue at allocation and kept out of it.
        self.held_blocks_skipped = 0
        # Blocks found already linked in the free queue when their last reference was
        # dropped (pushed there while held, by a bug): unlinked, then freed once.
        self.held_blocks_found_at_free = 0
        # Hash-index changes since the last take_cache_events(); None: not recording.
        self.cache_events: list[CacheEvent] | None = None
        # Set by the flight recorder: every block handed out or freed is listed there.
        self.trace: BlockTrace | None = None
        # Set when KV tiers are on: cached blocks evicted by allocation, to offload before
        # the step that reuses them writes them (see ``EvictedBlock``); None: not kept.
        self.evicted: list[EvictedBlock] | None = None
        # Blocks that went FREE (ref_cnt 0, no hash) since the last take_dead(): their
        # content is dead, nothing reads it before a write from offset 0 starts a new life.
        self.dead: list[int] = []

    # --------------------------------------------------------------- ownership
    def claim_ownership(self, thread_id: int | None = None) -> None:
        """Make ``thread_id`` (default: the calling thread) the only one allowed to mutate.

        Only an unowned pool can be claimed, or its owner hand it on: a claim from any
        other thread is a foreign mutation like the rest (``KVOwnershipError``).
        """
        self.check_owner()
        self.owner_thread = threading.get_ident() if thread_id is None else thread_id

    def check_owner(self) -> None:
        """Raise ``KVOwnershipError`` if the calling thread does not own the pool."""
        owner = self.owner_thread
        if owner is not None and threading.get_ident() != owner:
            self.ownership_violations += 1
            raise KVOwnershipError(
                f"block pool mutated from thread {threading.get_ident()}, but it is owned "
                f"by the engine-core thread {owner}; submit through the engine's queues"
            )

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or evictable cached-free)."""
        return self.free_queue.num_free

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block indexed under ``block_hash``, or None."""
        return self.hash_index.get(block_hash)

    def take_cache_events(self) -> list[CacheEvent]:
        """The hash-index changes since the last call, oldest first (see
        ``cache_events.py``). The first call starts the recording and returns []."""
        self.check_owner()
        events = self.cache_events or []
        self.cache_events = []
        return events

    # ------------------------------------------------------------- allocation
    def take_dead(self) -> list[int]:
        """Blocks that went FREE without a hash since the last call (the integrity guard
        unseals them: no scrub of content nobody can read again); clears the list."""
        self.check_owner()
        dead, self.dead = self.dead, []
        return dead

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Hand out ``n`` blocks with ref_cnt 1, evicting cached-free ones LRU-first."""
        self.check_owner()
        queue = self.free_queue
        if n > queue.num_free:
            raise BlockPoolExhausted(
                f"asked for {n} blocks but only {queue.num_free} are free; preempt a "
                f"request or raise num_blocks"
            )
        out = queue.popleft_many(n)
        if any(block.ref_cnt for block in out):
            out = self._skip_held(out, n)
        index = self.hash_index
        events = self.cache_events
        evicted = self.evicted
        for block in out:
            h = block.block_hash
            if h is not None:  # evict: as _drop_hash, inlined for the allocation path
                if index.get(h) is block:
                    del index[h]
                    if events is not None:
                        events.append(BlockRemoved(h))
                if evicted is not None and block.token_bytes is not None:
                    evicted.append(
                        EvictedBlock(block.block_id, h, block.parent_hash, block.token_bytes)
                    )
                block.block_hash = block.token_bytes = block.checksum = None
                block.parent_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            block.state = _USED
        self.num_allocations += n
        if self.trace is not None:
            self.trace.allocated.extend([block.block_id for block in out])
        return out

    def _skip_held(self, popped: list[KVBlock], n: int) -> list[KVBlock]:
        """``popped`` without the blocks that are still referenced (on the free queue by
        a bug: handing one out would give two requests one block), topped up to ``n``.
        The held blocks stay off the queue, in use; each is counted."""
        queue = self.free_queue
        good = []
        for block in popped:
            if block.ref_cnt:
                block.state = _USED
                self.held_blocks_skipped += 1
            else:
                good.append(block)
        while len(good) < n:
            if not queue.num_free:
                for block in reversed(good):
                    queue.appendleft(block)
                raise BlockPoolExhausted(
                    f"asked for {n} blocks but only {len(good)} free ones are left once "
                    f"held blocks are taken off the free queue; preempt a request"
                )
            block = queue.popleft()
            if block.ref_cnt:
                block.state = _USED
                self.held_blocks_skipped += 1
            else:
                good.append(block)
        return good

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit or a fork)."""
        self.check_owner()
        queue = self.free_queue
        for block in blocks:
            state = block.state
            if state is _CACHED_FREE or state is _FREE:
                queue.remove(block)
                block.state = _USED
                self.num_allocations += 1  # back in use: frees and allocations stay paired
            elif state is _QUARANTINED:
                raise QuarantinedBlockError(f"block {block.block_id} is quarantined")
            elif state is not _USED:
                raise BlockStateError(f"cannot reference {block}")
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each distinct block; the one idempotent free path.

        ``blocks`` is in eviction order (a request passes its table reversed, so the end
        of a chain is evicted before its start). A block listed twice is dropped once.
        A block reaching ref_cnt 0 bumps its epoch and returns to the free queue, hashed
        blocks at the tail (cached, evicted last), unhashed ones at the head (reused first).
        """
        self.check_owner()
        seen: set[int] = set()
        queue = self.free_queue
        cached: list[KVBlock] = []  # linked at the tail together, in order
        num_frees = self.num_frees
        trace = self.trace
        try:
            for block in blocks:
                bid = block.block_id
                if bid in seen:
                    continue
                seen.add(bid)
                ref_cnt = block.ref_cnt
                if ref_cnt <= 0:
                    raise BlockStateError(f"double free of {block}: ref_cnt is already 0")
                block.ref_cnt = ref_cnt = ref_cnt - 1
                if ref_cnt:
                    continue
                block.epoch += 1
                num_frees += 1
                if block.prev_free is not None:  # queued while still held: unlink first
                    queue.remove(block)
                    self.held_blocks_found_at_free += 1
                if trace is not None:
                    trace.freed.append(bid)
                if block.state is _QUARANTINED:
                    continue
                if block.block_hash is not None:
                    block.state = _CACHED_FREE
                    cached.append(block)
                else:
                    block.state = _FREE
                    queue.appendleft(block)
                    self.dead.append(bid)
        finally:  # a double free raises mid-way: still link and count what was freed
            self.num_frees = num_frees
            if cached:
                queue.extend(cached)

    # ----------------------------------------------------------------- caching
    def seal(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent_hash: BlockHash | None = None,
    ) -> None:
        """Record that ``block`` is full with ``token_ids`` and index it under ``block_hash``
        (``parent_hash``: the hash of the block before it, for the cache events).

        The hash is set once; if another block already holds this content, the index keeps
        that one and this block stays unindexed (it is still a correct, private copy).
        """
        self.check_owner()
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise BlockStateError(f"block {block.block_id} is already sealed with another hash")
            return
        if len(token_ids) != self.block_size:
            raise BlockStateError(
                f"only full blocks are sealed: {len(token_ids)} of {self.block_size} tokens"
            )
        if block.state is _QUARANTINED:
            return
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_bytes = pack_block_tokens(token_ids)
        if self.hash_index.setdefault(block_hash, block) is block and self.cache_events is not None:
            self.cache_events.append(BlockStored(block_hash, parent_hash, token_ids))

    def drop_cached(self) -> int:
        """Forget the prefix-cache entries of every block nobody holds (CACHED_FREE ->
        FREE, in place in the queue); returns how many. Held blocks keep theirs."""
        self.check_owner()
        dropped = 0
        for block in self.blocks:
            if block.state is _CACHED_FREE:
                self._drop_hash(block)
                block.state = _FREE
                dropped += 1
        return dropped

    def _drop_hash(self, block: KVBlock) -> None:
        h = block.block_hash
        if h is not None and self.hash_index.get(h) is block:
            del self.hash_index[h]
            if self.cache_events is not None:
                self.cache_events.append(BlockRemoved(h))
        block.block_hash = None
        block.parent_hash = None
        block.token_bytes = None
        block.checksum = None

    # -------------------------------------------------------------- quarantine
    def quarantine(self, block_id: int) -> None:
        """Take a suspect block out of service: out of the hash index and the free queue.

        Holders keep their references (they are rolled back by the caller); when the last
        one frees it, it stays out of the queue until ``release_quarantine``.
        """
        self.check_owner()
        if block_id == RESERVED_BLOCK_ID or not 0 < block_id < self.num_blocks:
            raise BlockStateError(f"cannot quarantine block {block_id}")
        self.failure_counts[block_id] = self.failure_counts.get(block_id, 0) + 1
        if self.failure_counts[block_id] >= MAX_BLOCK_FAILURES:
            self.retired.add(BlockId(block_id))
        block = self.blocks[block_id]
        if block.state is _QUARANTINED:
            return
        self._drop_hash(block)
        if block.state is _FREE or block.state is _CACHED_FREE:
            self.free_queue.remove(block)
        block.state = _QUARANTINED
        self.quarantined.add(BlockId(block_id))

    def release_quarantine(self, block_id: int) -> None:
        """Return a quarantined block to service (to the free queue if nobody holds it).

        Call it only after the block was scrubbed and re-verified; a retired block (one
        that failed ``MAX_BLOCK_FAILURES`` checks) never returns.
        """
        self.check_owner()
        block = self.blocks[block_id]
        if block.state is not _QUARANTINED:
            raise BlockStateError(f"block {block_id} is not quarantined")
        if block_id in self.retired:
            raise BlockStateError(
                f"block {block_id} failed {MAX_BLOCK_FAILURES} checks and is retired for good"
            )
        self.quarantined.discard(BlockId(block_id))
        if block.ref_cnt:
            block.state = _USED
        else:
            block.state = _FREE
            self.free_queue.appendleft(block)

    # ----------------------------------------------------------------- recovery
    def reconcile(self, held: Sequence[int]) -> list[int]:
        """Make every block's ref_cnt, state and free-queue link agree with ``held[b]``,
        the references block tables really hold; returns the ids it had to change.

        The recovery of last resort after a metadata fault (a reference freed by the wrong
        entry, a held block pushed on the free queue): a block nobody holds goes back to
        the queue with its epoch bumped, a held one leaves the queue, and the queue is
        rebuilt from the blocks that should be on it, in their old order, so it is whole
        even if its links were damaged. Quarantined blocks stay out of the queue.
        """
        self.check_owner()
        assert len(held) == self.num_blocks
        old_order: list[KVBlock] = []
        linked: set[int] = set()
        for block in self.free_queue:  # bounded: a damaged queue may loop
            if block.block_id in linked or len(linked) >= self.num_blocks:
                break
            linked.add(block.block_id)
            old_order.append(block)
        changed: list[int] = []
        queued: set[int] = set()  # the blocks the rebuilt queue holds
        for block in self.blocks[1:]:
            bid, n = block.block_id, held[block.block_id]
            block.prev_free = block.next_free = None
            if block.state is _QUARANTINED:
                pass
            elif n > 0:
                if block.state is not _USED or block.ref_cnt != n or bid in linked:
                    block.state = _USED
                    changed.append(bid)
            else:
                free_state = _CACHED_FREE if block.block_hash is not None else _FREE
                if block.state is _USED or block.ref_cnt or bid not in linked:
                    block.epoch += 1  # every reference taken before is stale now
                    block.state = free_state
                    self.num_frees += 1
                    if self.trace is not None:
                        self.trace.freed.append(bid)
                    changed.append(bid)
                elif block.state is not free_state:  # queued, but FREE with a hash or
                    block.state = free_state  # CACHED_FREE without one
                    changed.append(bid)
                queued.add(bid)
            block.ref_cnt = n
        order = [b for b in old_order if b.block_id in queued]
        order += [b for b in self.blocks[1:] if b.block_id in queued and b.block_id not in linked]
        self.free_queue.reset(order)
        return changed

    # ------------------------------------------------------------------ counts
    def state_counts(self) -> dict[BlockState, int]:
        """How many blocks are in each state."""
        counts = {s: 0 for s in BlockState}
        for block in self.blocks:
            counts[block.state] += 1
        return counts
