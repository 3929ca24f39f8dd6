"""Per-request block tables over a ``BlockPool``: prefix lookup, allocation, fork, free.

Slot arithmetic (``block_size = 4``)::

    table = [7, 3]     position p -> slot table[p // 4] * 4 + p % 4
    p = 5            -> 3 * 4 + 1 = 13

A table owns one reference on each distinct block it lists. Forked children share the
parent's blocks by reference count; the partially filled last block is copied on write
when a child first appends to it (``allocate_slots`` returns the ``(src, dst)`` pair).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagewarden.kv import audit
from pagewarden.kv.block import BlockHash, BlockRef, BlockState, KVBlock
from pagewarden.kv.block_pool import BlockPool
from pagewarden.kv.block_table import RequestBlocks, first_unsound_entry, held_counts
from pagewarden.kv.cache_events import BlockStored
from pagewarden.kv.errors import (
    DuplicateRequestError,
    QuarantinedBlockError,
    StaleBlockError,
    UnknownRequestError,
)
from pagewarden.kv.prefix_hash import hash_and_pack_block, pack_block_tokens
from pagewarden.kv.swap_space import BlockSwap, SwappedTable, SwapSpace


class KVCacheManager:
    """Owns the pool, every request's block table and the host (swap) tier.

    Single-threaded by design. A request has a device table (``tables``) or a swapped
    table (``swap.tables``), never both.

    Ownership: every public mutator calls ``pool.check_owner()`` before it changes
    anything, so a call from a thread other than the owner raises ``KVOwnershipError``
    and leaves tables, pool and host tier exactly as they were.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.swap = SwapSpace(num_host_blocks, self.pool.check_owner)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, RequestBlocks] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens served from cache
        self.stale_refs_dropped = 0  # stale refs found (and skipped) when freeing a table
        # Blocks whose ref count disagreed with the tables after an abort (see
        # ``reconcile_after_free``), set right.
        self.refcounts_fixed_at_free = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def has_table(self, req_id: str) -> bool:
        return req_id in self.tables

    def block_ids(self, req_id: str) -> list[int]:
        """A copy of the request's block table as plain block ids."""
        return list(self._entry(req_id).ids)

    def block_refs(self, req_id: str) -> list[BlockRef]:
        return list(self._entry(req_id).refs)

    def resolve(self, ref: BlockRef) -> KVBlock:
        """The block ``ref`` names; raises ``StaleBlockError`` if it was freed since."""
        block = self.pool.blocks[ref.block_id]
        if block.epoch != ref.epoch or block.ref_cnt == 0:
            raise StaleBlockError(
                f"block {ref.block_id} epoch is {block.epoch}, the reference holds epoch "
                f"{ref.epoch}: it was freed and possibly reused; recompute instead"
            )
        if block.state is BlockState.QUARANTINED:
            raise QuarantinedBlockError(f"block {ref.block_id} is quarantined")
        return block

    def slot_mapping(self, req_id: str, start: int, end: int) -> list[int]:
        """Physical slots of positions ``[start, end)``."""
        ids = self._entry(req_id).ids
        bs = self.block_size
        return [ids[p // bs] * bs + p % bs for p in range(start, end)]

    def _entry(self, req_id: str) -> RequestBlocks:
        entry = self.tables.get(req_id)
        if entry is None:
            raise UnknownRequestError(f"no block table for request {req_id!r}")
        return entry

    # ------------------------------------------------------------ prefix cache
    def lookup_prefix(
        self, req_id: str, token_ids: Sequence[int], extra_keys: bytes, max_tokens: int
    ) -> int:
        """Create ``req_id``'s table and pin its cached prefix; return cached token count.

        At most ``max_tokens`` tokens (rounded down to whole blocks) are served, so the
        caller can always leave the last token to compute. Hit blocks are pinned (ref_cnt
        incremented) at once, so no allocation in the same pass can evict them.
        """
        self.pool.check_owner()
        if req_id in self.tables:
            raise DuplicateRequestError(f"request {req_id!r} already has a block table")
        entry = RequestBlocks(extra_keys)
        self.tables[req_id] = entry
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        max_blocks = max(0, max_tokens) // bs
        self.prefix_cache_queries += max_blocks * bs
        pool = self.pool
        index = pool.hash_index
        hits: list[KVBlock] = []
        hashes = entry.hashes
        parent: BlockHash | None = None
        for i in range(max_blocks):
            h, packed = hash_and_pack_block(parent, token_ids[i * bs : (i + 1) * bs], extra_keys)
            hashes.append(h)
            block = index.get(h)
            if block is None or block.token_bytes != packed:
                entry.miss = (i, packed)
                break
            hits.append(block)
            parent = h
        if hits:
            pool.touch(hits)
            refs = entry.refs
            ids = entry.ids
            for b in hits:
                refs.append(_ref(b))
                ids.append(b.block_id)  # a new table: not handed out yet
        num_hit = len(hits)
        entry.num_sealed = num_hit
        self.prefix_cache_hits += num_hit * bs
        return num_hit * bs

    def create_table(self, req_id: str, extra_keys: bytes) -> None:
        """An empty table (no prefix lookup)."""
        self.pool.check_owner()
        if req_id in self.tables:
            raise DuplicateRequestError(f"request {req_id!r} already has a block table")
        self.tables[req_id] = RequestBlocks(extra_keys)

    # -------------------------------------------------------------- allocation
    def allocate_slots(
        self, req_id: str, num_computed: int, num_new: int
    ) -> list[tuple[int, int]] | None:
        """Make positions ``[num_computed, num_computed + num_new)`` writable.

        Returns the copy-on-write pairs ``(src, dst)`` to apply before the step (usually
        empty; treat as read-only), or None (with nothing changed) when the pool has too few free blocks.
        """
        self.pool.check_owner()
        entry = self.tables[req_id]
        ids = entry.ids
        bs = self.block_size
        pool = self.pool
        need = (num_computed + num_new + bs - 1) // bs - len(ids)
        cow_index = -1
        if num_computed % bs:
            idx = num_computed // bs
            if idx < len(ids) and pool.blocks[ids[idx]].ref_cnt > 1:
                cow_index = idx
        total = (need if need > 0 else 0) + (cow_index >= 0)
        if total == 0:
            return _NO_COPIES
        if total > pool.free_queue.num_free:
            return None
        copies: list[tuple[int, int]] = []
        ids = ids[:]  # never mutate a list a ScheduledRequest may hold
        if cow_index >= 0:
            src = pool.blocks[ids[cow_index]]
            (dst,) = pool.get_new_blocks(1)
            pool.free_blocks((src,))  # ref_cnt > 1, so this never frees the source
            entry.refs[cow_index] = _ref(dst)
            ids[cow_index] = dst.block_id
            entry.ids = ids
            copies.append((src.block_id, dst.block_id))
        if need > 0:
            refs = entry.refs
            for b in pool.get_new_blocks(need):
                refs.append(_ref(b))
                ids.append(b.block_id)
            entry.ids = ids
        return copies

    def seal_full_blocks(self, req_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Hash and index every block that ``num_computed`` computed tokens have filled."""
        self.pool.check_owner()
        if not self.enable_prefix_caching:
            return
        entry = self.tables[req_id]
        bs = self.block_size
        num_full = num_computed // bs
        if num_full <= entry.num_sealed:
            return
        hashes = entry.hashes
        pool = self.pool
        blocks = pool.blocks
        index = pool.hash_index
        events = pool.cache_events
        ids = entry.ids
        for i in range(entry.num_sealed, num_full):
            chunk = token_ids[i * bs : (i + 1) * bs]
            if i < len(hashes):  # computed at lookup (the first miss): never hash twice
                h = hashes[i]
                miss = entry.miss
                packed = miss[1] if miss is not None and miss[0] == i else pack_block_tokens(chunk)
            else:
                h, packed = hash_and_pack_block(
                    hashes[i - 1] if i else None, chunk, entry.extra_keys
                )
                hashes.append(h)
            block = blocks[ids[i]]
            if block.block_hash is None and block.state is _USED:
                # pool.seal's common case, inlined: a full, unsealed block in use.
                block.block_hash = h
                block.parent_hash = hashes[i - 1] if i else None
                block.token_bytes = packed
                if index.setdefault(h, block) is block and events is not None:
                    events.append(BlockStored(h, hashes[i - 1] if i else None, chunk))
            else:
                pool.seal(block, h, chunk, hashes[i - 1] if i else None)
        entry.num_sealed = num_full

    # ------------------------------------------------------------ fork & free
    def fork(self, parent_id: str, child_ids: Sequence[str]) -> None:
        """Give each child a table sharing all of the parent's blocks; drop the parent's.

        The parent's own references pass to the children, so each block's ref_cnt grows
        by ``len(child_ids) - 1``.
        """
        self.pool.check_owner()
        for cid in child_ids:
            if cid in self.tables:
                raise DuplicateRequestError(f"request {cid!r} already has a block table")
        entry = self.tables.pop(parent_id)
        if not child_ids:
            self.pool.free_blocks(self.pool.blocks[i] for i in reversed(entry.ids))
            return
        extra = len(child_ids) - 1
        blocks = self.pool.blocks
        for bid in entry.ids:
            blocks[bid].ref_cnt += extra
        for cid in child_ids:
            child = RequestBlocks(entry.extra_keys)
            child.refs = list(entry.refs)
            child.ids = entry.ids  # shared: ids is replaced, never mutated
            child.hashes = list(entry.hashes)
            child.miss = entry.miss
            child.num_sealed = entry.num_sealed
            self.tables[cid] = child

    def free(self, req_id: str) -> None:
        """Release the request's table (device or swapped); a second call (or an unknown
        id) is a no-op."""
        self.pool.check_owner()
        if self.swap.tables:
            swapped = self.swap.tables.pop(req_id, None)
            if swapped is not None:
                self.swap.release(swapped.host_ids)
        entry = self.tables.pop(req_id, None)
        if entry is None:
            return
        blocks = self.pool.blocks
        # Free by epoch-tagged ref: an entry whose block was freed under it (a stale ref)
        # no longer holds a reference, so dropping it must not decrement anything.
        live = []
        for block_id, epoch in reversed(entry.refs):
            block = blocks[block_id]
            if block.epoch == epoch and block.ref_cnt > 0:
                live.append(block)
            else:
                self.stale_refs_dropped += 1
        self.pool.free_blocks(live)

    # -------------------------------------------------------------------- swap
    def is_swapped(self, req_id: str) -> bool:
        return req_id in self.swap.tables

    def swap_out(self, req_id: str, num_tokens: int) -> list[BlockSwap] | None:
        """Move the request's KV (``num_tokens`` tokens) to host blocks; free its device
        blocks. Returns the device -> host copies, or None (nothing changed) when the host
        tier has too few free blocks.

        The worker copies before the step's forward pass, so device blocks freed here can
        be handed out again in the same step.
        """
        self.pool.check_owner()
        entry = self._entry(req_id)
        if req_id in self.swap.tables:
            raise DuplicateRequestError(f"request {req_id!r} is already swapped out")
        ids = entry.ids
        bs = self.block_size
        assert len(ids) == (num_tokens + bs - 1) // bs, (
            f"{req_id}: {len(ids)} blocks do not hold exactly {num_tokens} tokens"
        )
        host_ids = self.swap.allocate(len(ids))
        if host_ids is None:
            return None
        swaps = [
            BlockSwap(d, h, _slots_used(i, num_tokens, bs))
            for i, (d, h) in enumerate(zip(ids, host_ids))
        ]
        self.free(req_id)
        self.swap.tables[req_id] = SwappedTable(
            host_ids, entry.hashes, entry.extra_keys, num_tokens
        )
        self.swap.num_swapped_out += len(host_ids)
        return swaps

    def swap_in(self, req_id: str) -> list[BlockSwap] | None:
        """Bring a swapped request's KV back into fresh device blocks; returns the host ->
        device copies, or None (nothing changed) when the pool has too few free blocks.

        The new blocks are private; full ones are indexed for prefix caching again the
        next time the request seals (their hashes are kept, not recomputed).
        """
        self.pool.check_owner()
        table = self.swap.tables.get(req_id)
        if table is None:
            raise UnknownRequestError(f"request {req_id!r} is not swapped out")
        if req_id in self.tables:
            raise DuplicateRequestError(f"request {req_id!r} already has a block table")
        host_ids = table.host_ids
        if len(host_ids) > self.pool.free_queue.num_free:
            return None
        blocks = self.pool.get_new_blocks(len(host_ids))
        entry = RequestBlocks(table.extra_keys)
        entry.refs = [_ref(block) for block in blocks]
        entry.ids = [block.block_id for block in blocks]
        entry.hashes = table.hashes
        self.tables[req_id] = entry
        del self.swap.tables[req_id]
        self.swap.release(host_ids)
        self.swap.num_swapped_in += len(host_ids)
        bs = self.block_size
        return [
            BlockSwap(h, d, _slots_used(i, table.num_tokens, bs))
            for i, (h, d) in enumerate(zip(host_ids, entry.ids))
        ]

    # --------------------------------------------------------------- integrity
    def first_unsound_block(self, req_id: str) -> int | None:
        """Index of the first table entry that no longer names a live block, or None.

        An entry is unsound when its ``BlockRef`` epoch no longer matches the block (the
        block was freed while this table still listed it: use after free), when the plain
        id list disagrees with the refs (a corrupted table entry), or when the block it
        names is linked in the free queue or counts no reference (freed, or pushed on the
        free queue, while still held: the next allocation would hand it to another
        request with the same epoch).
        """
        return first_unsound_entry(self._entry(req_id), self.pool.blocks)

    def held_counts(self) -> list[int]:
        """References the tables really hold, per block id (``block_table.held_counts``)."""
        return held_counts(self.tables.values(), self.pool.blocks)

    def overshared_blocks(self) -> list[int]:
        """Blocks more tables hold than their ref_cnt counts (a table entry rewritten to
        another request's block, or a reference never taken): whoever wrote there may
        have overwritten the others' K/V."""
        held = self.held_counts()
        return [b.block_id for b in self.pool.blocks[1:] if held[b.block_id] > b.ref_cnt]

    def refcount_mismatches(self) -> list[int]:
        """Blocks whose ref_cnt differs from the references held, or that are held yet
        linked in the free queue."""
        held = self.held_counts()
        return [
            b.block_id
            for b in self.pool.blocks[1:]
            if b.ref_cnt != held[b.block_id] or (held[b.block_id] and b.prev_free is not None)
        ]

    def reconcile(self) -> list[int]:
        """Set ref counts and the free queue from the references the tables hold
        (``BlockPool.reconcile``); returns the block ids that changed. Run after the
        holders of inconsistent blocks were rolled back."""
        self.pool.check_owner()
        return self.pool.reconcile(self.held_counts())

    def reconcile_after_free(self) -> list[int]:
        """Set ref counts right if freeing tables out of step (an abort) left them wrong.

        An abort can land between a metadata fault and the next step's table check: a
        table entry rewritten to another request's block then frees that block instead
        of its own (one leaked, one under-counted), a held block pushed on the free queue
        is queued twice. A step would catch these by slot tag or table check; a table
        freed before any step reads it is checked here instead, against the references
        the remaining tables hold (one pass over them). Returns the blocks fixed.
        """
        self.pool.check_owner()
        if not self.refcount_mismatches():
            return []
        changed = self.reconcile()
        self.refcounts_fixed_at_free += len(changed)
        return changed

    def holders(self, block_ids: set[int]) -> dict[str, int]:
        """Each request whose table lists one of ``block_ids`` -> index of the first one."""
        found: dict[str, int] = {}
        for req_id, entry in self.tables.items():
            for i, ref in enumerate(entry.refs):
                if ref.block_id in block_ids:
                    found[req_id] = i
                    break
        return found

    def truncate(self, req_id: str, num_blocks: int) -> None:
        """Keep logical blocks ``[0, num_blocks)`` of the table and drop the rest.

        Dropped entries whose ref is still live release their reference; a stale one
        (freed under the table already) is dropped without touching the block, which now
        belongs to someone else.
        """
        self.pool.check_owner()
        entry = self._entry(req_id)
        dropped = entry.refs[num_blocks:]
        del entry.refs[num_blocks:]
        entry.ids = entry.ids[:num_blocks]  # replaced, never mutated (see RequestBlocks)
        entry.num_sealed = min(entry.num_sealed, num_blocks)
        blocks = self.pool.blocks
        live = [
            blocks[r.block_id]
            for r in reversed(dropped)
            if blocks[r.block_id].epoch == r.epoch and blocks[r.block_id].ref_cnt > 0
        ]
        if live:
            self.pool.free_blocks(live)

    # ------------------------------------------------------------------- audit
    def check_invariants(self) -> list[str]:
        """Violations of the pool/table and host-tier invariants; empty when sound."""
        errors = audit.check_invariants(self.pool, {k: v.refs for k, v in self.tables.items()})
        errors += self.swap.check_invariants()
        both = set(self.tables) & set(self.swap.tables)
        if both:
            errors.append(f"requests with both a device and a swapped table: {sorted(both)}")
        return errors


_NO_COPIES: list[tuple[int, int]] = []
_USED = BlockState.USED


def _slots_used(index: int, num_tokens: int, block_size: int) -> int:
    """Slots of logical block ``index`` that ``num_tokens`` tokens fill."""
    return min(block_size, num_tokens - index * block_size)


_new_tuple = tuple.__new__


def _ref(block: KVBlock) -> BlockRef:
    """``BlockRef(block.block_id, block.epoch)``, without the NamedTuple's Python-level
    ``__new__`` (half the cost; tables take one per allocated block)."""
    return _new_tuple(BlockRef, (block.block_id, block.epoch))
