"""``KVCacheManager.reconcile``: ref counts and the free queue rebuilt from the references
the tables really hold, after the metadata faults that break them."""

from __future__ import annotations

from pagewarden.kv.block import BlockRef, BlockState
from pagewarden.kv.kv_manager import KVCacheManager


def _manager() -> KVCacheManager:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    for rid in ("a", "b"):
        kv.create_table(rid, b"")
        assert kv.allocate_slots(rid, 0, 12) == []  # 3 blocks each
    return kv


def test_a_coherent_wrong_ref_then_rollback_frees_by_the_block_really_held() -> None:
    kv = _manager()
    a, b = kv.tables["a"], kv.tables["b"]
    orphan, shared = a.ids[1], b.ids[1]
    # The fault: a's entry 1 names b's block, with b's current epoch (coherent).
    a.refs[1] = BlockRef(shared, kv.pool.blocks[shared].epoch)
    a.ids = [a.ids[0], shared, a.ids[2]]
    assert kv.overshared_blocks() == [shared]
    assert set(kv.refcount_mismatches()) == {orphan, shared}
    # Recovery as the scheduler runs it: quarantine, roll both holders back, reconcile.
    kv.pool.quarantine(shared)
    kv.truncate("a", 1)
    kv.truncate("b", 1)
    assert kv.check_invariants() != []  # truncating by refs alone leaks the orphan
    changed = kv.reconcile()
    assert orphan in changed
    assert kv.pool.blocks[orphan].state is BlockState.FREE
    assert kv.check_invariants() == []
    kv.free("a")
    kv.free("b")
    counts = kv.pool.state_counts()
    assert counts[BlockState.USED] == 0 and counts[BlockState.QUARANTINED] == 1


def test_a_held_block_is_taken_off_the_free_queue_without_an_epoch_change() -> None:
    kv = _manager()
    held = kv.pool.blocks[kv.tables["a"].ids[0]]
    epoch = held.epoch
    kv.pool.free_queue.appendleft(held)  # the fault: pushed while referenced
    assert kv.first_unsound_block("a") == 0
    assert kv.reconcile() == [held.block_id]
    assert held.prev_free is None and held.state is BlockState.USED and held.epoch == epoch
    assert kv.first_unsound_block("a") is None
    assert kv.check_invariants() == []


def test_a_damaged_free_queue_is_rebuilt_in_its_old_order() -> None:
    kv = _manager()
    queue = kv.pool.free_queue
    before = queue.ids()
    first = kv.pool.blocks[before[0]]
    queue.remove(first)  # a free block lost from the queue
    assert kv.check_invariants() != []
    assert kv.reconcile() == [first.block_id]
    assert queue.ids() == before[1:] + [first.block_id]
    assert kv.check_invariants() == []


def test_a_queued_block_in_the_wrong_free_state_is_set_from_its_hash() -> None:
    kv = _manager()
    free = kv.pool.blocks[kv.pool.free_queue.ids()[0]]
    assert free.state is BlockState.FREE and free.block_hash is None
    free.state = BlockState.CACHED_FREE  # the fault: cached-free without a hash
    assert kv.check_invariants() != []
    assert kv.reconcile() == [free.block_id]
    assert free.state is BlockState.FREE
    assert kv.check_invariants() == []


def test_an_abort_after_a_coherent_wrong_ref_leaves_no_leak_or_double_count() -> None:
    kv = _manager()
    a, b = kv.tables["a"], kv.tables["b"]
    orphan, shared = a.ids[1], b.ids[1]
    a.refs[1] = BlockRef(shared, kv.pool.blocks[shared].epoch)
    a.ids = [a.ids[0], shared, a.ids[2]]
    kv.free("a")  # frees b's block instead of its own
    assert kv.check_invariants() != []
    assert set(kv.reconcile_after_free()) >= {orphan}
    assert kv.refcounts_fixed_at_free >= 1
    assert kv.pool.blocks[orphan].state is BlockState.FREE  # not leaked
    # b's entry went stale with the wrong free: the next step's table check rolls b
    # back to before it, as here.
    assert kv.first_unsound_block("b") == 1
    kv.truncate("b", 1)
    assert kv.check_invariants() == []
    kv.free("b")
    assert kv.pool.state_counts()[BlockState.USED] == 0


def test_a_held_block_queued_by_a_fault_is_linked_once_when_freed() -> None:
    kv = _manager()
    held = kv.pool.blocks[kv.tables["a"].ids[0]]
    kv.pool.free_queue.appendleft(held)  # the fault: pushed while referenced
    num_free = kv.pool.free_queue.num_free
    kv.free("a")
    assert kv.pool.held_blocks_found_at_free == 1
    assert kv.pool.free_queue.ids().count(held.block_id) == 1
    assert kv.pool.free_queue.num_free == num_free + 2  # a's other two blocks
    assert kv.check_invariants() == []
