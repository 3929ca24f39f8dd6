"""Block pool: exact block ids, free-queue order, ref counts, epochs, quarantine."""

from __future__ import annotations

import pytest

from pagewarden.kv import (
    BlockPool,
    BlockPoolExhausted,
    BlockState,
    BlockStateError,
    FreeBlockQueue,
    KVBlock,
)
from pagewarden.kv.audit import check_invariants
from pagewarden.kv.prefix_hash import hash_block_tokens


def _h(tokens: list[int]):
    return hash_block_tokens(None, tokens, b"")


def test_block_zero_is_reserved_and_queue_starts_in_id_order() -> None:
    pool = BlockPool(6, 4)
    assert pool.free_queue.ids() == [1, 2, 3, 4, 5]
    assert pool.blocks[0].state is BlockState.RESERVED
    assert pool.num_free_blocks == 5
    assert check_invariants(pool, {}) == []


def test_get_new_blocks_pops_head_and_sets_ref_cnt() -> None:
    pool = BlockPool(6, 4)
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert all(b.state is BlockState.USED for b in blocks)
    assert pool.free_queue.ids() == [3, 4, 5]
    assert pool.num_allocations == 2


def test_prefix_hit_on_a_cached_free_block_counts_as_an_allocation() -> None:
    # allocations - frees is the number of blocks in use: a cached-free block taken back
    # by a prefix hit leaves the free pool, and its later free must be paired with it.
    pool = BlockPool(6, 4)
    (b1,) = pool.get_new_blocks(1)
    pool.seal(b1, _h([1, 2, 3, 4]), [1, 2, 3, 4])
    pool.free_blocks([b1])
    assert b1.state is BlockState.CACHED_FREE
    pool.touch([b1])
    (b2,) = pool.get_new_blocks(1)
    pool.touch([b2])  # a fork of a used block is not an allocation
    assert pool.num_allocations - pool.num_frees == 2
    pool.free_blocks([b1, b2])
    pool.free_blocks([b2])
    assert pool.num_allocations == pool.num_frees == 3


def test_exhaustion_raises_and_changes_nothing() -> None:
    pool = BlockPool(4, 4)
    with pytest.raises(BlockPoolExhausted, match="only 3 are free"):
        pool.get_new_blocks(4)
    assert pool.free_queue.ids() == [1, 2, 3]


def test_unhashed_blocks_return_to_head_and_epoch_bumps() -> None:
    pool = BlockPool(6, 4)
    b1, b2 = pool.get_new_blocks(2)
    pool.free_blocks([b2, b1])
    assert pool.free_queue.ids() == [1, 2, 3, 4, 5]
    assert (b1.epoch, b2.epoch) == (1, 1)
    assert b1.state is BlockState.FREE and b1.ref_cnt == 0


def test_hashed_blocks_return_tail_first_so_chain_end_is_evicted_first() -> None:
    pool = BlockPool(6, 4)
    b1, b2, b3 = pool.get_new_blocks(3)
    pool.seal(b1, _h([1, 2, 3, 4]), [1, 2, 3, 4])
    pool.seal(b2, _h([5, 6, 7, 8]), [5, 6, 7, 8])
    pool.free_blocks([b3, b2, b1])  # table reversed
    # b3 has no hash: reused first; b2 (chain end) evicted before b1 (chain start).
    assert pool.free_queue.ids() == [3, 4, 5, 2, 1]
    assert b1.state is BlockState.CACHED_FREE and b3.state is BlockState.FREE
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [3, 4, 5, 2]
    assert b2.block_hash is None and _h([5, 6, 7, 8]) not in pool.hash_index
    assert pool.get_cached_block(_h([1, 2, 3, 4])) is b1
    assert pool.num_evictions == 1


def test_take_dead_lists_the_blocks_freed_without_a_hash_once() -> None:
    """Dead content: ref_cnt 0 and no hash (nothing can read it before a rewrite). A
    cached block, a block still held by another reference and a quarantined one are not
    dead; each take clears the list."""
    pool = BlockPool(8, 4)
    b1, b2, b3, b4, b5 = pool.get_new_blocks(5)
    pool.seal(b1, _h([1, 2, 3, 4]), [1, 2, 3, 4])
    pool.touch([b2])  # a second reference (a prefix hit, a fork)
    pool.quarantine(b4.block_id)
    assert pool.take_dead() == []
    pool.free_blocks([b5, b4, b3, b2, b1])
    assert pool.take_dead() == [5, 3]  # b2 still held once, b1 cached, b4 quarantined
    assert pool.take_dead() == []
    pool.free_blocks([b2])
    assert pool.take_dead() == [2]


def test_touch_removes_cached_free_block_from_the_middle() -> None:
    pool = BlockPool(6, 4)
    b1, b2 = pool.get_new_blocks(2)
    pool.seal(b1, _h([1, 1, 1, 1]), [1, 1, 1, 1])
    pool.free_blocks([b2, b1])
    assert pool.free_queue.ids() == [2, 3, 4, 5, 1]
    b3 = pool.blocks[3]
    pool.seal(pool.get_new_blocks(1)[0], _h([9, 9, 9, 9]), [9, 9, 9, 9])  # takes 2
    assert pool.free_queue.ids() == [3, 4, 5, 1]
    pool.touch([pool.blocks[4]])
    assert pool.free_queue.ids() == [3, 5, 1]
    assert pool.blocks[4].ref_cnt == 1 and b3.ref_cnt == 0


def test_free_dedupes_a_block_listed_twice() -> None:
    pool = BlockPool(4, 4)
    (b1,) = pool.get_new_blocks(1)
    pool.touch([b1])
    assert b1.ref_cnt == 2
    pool.free_blocks([b1, b1])
    assert b1.ref_cnt == 1
    pool.free_blocks([b1])
    assert b1.ref_cnt == 0 and b1.epoch == 1
    assert pool.free_queue.ids().count(1) == 1
    with pytest.raises(BlockStateError, match="double free"):
        pool.free_blocks([b1])
    assert pool.free_queue.ids().count(1) == 1


def test_seal_is_set_once_and_only_for_full_blocks() -> None:
    pool = BlockPool(4, 4)
    (b1,) = pool.get_new_blocks(1)
    with pytest.raises(BlockStateError, match="only full blocks"):
        pool.seal(b1, _h([1, 2]), [1, 2])
    pool.seal(b1, _h([1, 2, 3, 4]), [1, 2, 3, 4])
    pool.seal(b1, _h([1, 2, 3, 4]), [1, 2, 3, 4])  # same hash: no-op
    with pytest.raises(BlockStateError, match="another hash"):
        pool.seal(b1, _h([4, 3, 2, 1]), [4, 3, 2, 1])


def test_duplicate_content_keeps_first_index_entry() -> None:
    pool = BlockPool(4, 4)
    b1, b2 = pool.get_new_blocks(2)
    h = _h([1, 2, 3, 4])
    pool.seal(b1, h, [1, 2, 3, 4])
    pool.seal(b2, h, [1, 2, 3, 4])
    assert pool.hash_index[h] is b1
    pool.free_blocks([b2])
    pool.get_new_blocks(2)  # evicts 3 then b2 (unindexed): b1's entry survives
    assert pool.hash_index[h] is b1
    assert check_invariants(pool, {}) != []  # tables not given: ref counts disagree
    assert [e for e in check_invariants(pool, {}) if "hash index" in e] == []


def test_quarantine_free_block_and_release() -> None:
    pool = BlockPool(5, 4)
    (b1,) = pool.get_new_blocks(1)
    pool.seal(b1, _h([1, 2, 3, 4]), [1, 2, 3, 4])
    pool.free_blocks([b1])
    assert pool.free_queue.ids() == [2, 3, 4, 1]
    pool.quarantine(1)
    assert pool.free_queue.ids() == [2, 3, 4]
    assert pool.hash_index == {} and b1.block_hash is None
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 3, 4]
    with pytest.raises(BlockPoolExhausted):
        pool.get_new_blocks(1)
    pool.release_quarantine(1)
    assert pool.free_queue.ids() == [1] and b1.state is BlockState.FREE


def test_quarantine_used_block_stays_out_after_last_free() -> None:
    pool = BlockPool(4, 4)
    (b1,) = pool.get_new_blocks(1)
    pool.quarantine(1)
    assert b1.ref_cnt == 1 and b1.state is BlockState.QUARANTINED
    pool.free_blocks([b1])
    assert b1.ref_cnt == 0 and b1.epoch == 1
    assert pool.free_queue.ids() == [2, 3]
    assert check_invariants(pool, {}) == []
    pool.release_quarantine(1)
    assert pool.free_queue.ids() == [1, 2, 3]
    with pytest.raises(BlockStateError):
        pool.quarantine(0)


def test_free_queue_remove_and_errors() -> None:
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.ids() == [0, 1, 3] and len(q) == 3
    with pytest.raises(ValueError):
        q.remove(blocks[2])
    q.appendleft(blocks[2])
    assert q.ids() == [2, 0, 1, 3]
    assert [q.popleft().block_id for _ in range(4)] == [2, 0, 1, 3]
    with pytest.raises(IndexError):
        q.popleft()


def test_free_queue_popleft_many_and_extend_keep_order() -> None:
    blocks = [KVBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks[:4])
    assert [b.block_id for b in q.popleft_many(2)] == [0, 1]
    assert q.ids() == [2, 3] and len(q) == 2 == q.num_free
    q.extend([blocks[5], blocks[0]])
    assert q.ids() == [2, 3, 5, 0] and len(q) == 4
    with pytest.raises(IndexError):
        q.popleft_many(5)
    assert q.ids() == [2, 3, 5, 0]  # nothing unlinked by the failed pop
    assert [b.block_id for b in q.popleft_many(4)] == [2, 3, 5, 0] and q.ids() == []
