"""KV manager: block tables, prefix hits with pinning, COW fork, idempotent free, stale refs."""

from __future__ import annotations

import pytest

from pagewarden.kv import BlockRef, KVCacheManager, StaleBlockError
from pagewarden.kv.errors import DuplicateRequestError, UnknownRequestError
from pagewarden.kv.prefix_hash import encode_extra_keys, pack_block_tokens

E = encode_extra_keys("model", None)


def _run(kv: KVCacheManager, rid: str, tokens: list[int], extra: bytes = E) -> int:
    """Lookup + allocate + 'compute' + seal the whole of ``tokens``; return cached count."""
    cached = kv.lookup_prefix(rid, tokens, extra, len(tokens) - 1)
    assert kv.allocate_slots(rid, cached, len(tokens) - cached) is not None
    kv.seal_full_blocks(rid, tokens, len(tokens))
    return cached


def test_allocate_exact_ids_and_slot_mapping() -> None:
    kv = KVCacheManager(8, 4)
    kv.create_table("a", E)
    assert kv.allocate_slots("a", 0, 6) == []
    assert kv.block_ids("a") == [1, 2]
    assert kv.slot_mapping("a", 3, 6) == [1 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]
    assert kv.allocate_slots("a", 6, 2) == []  # fits in block 2
    assert kv.block_ids("a") == [1, 2]
    assert kv.allocate_slots("a", 8, 1) == []
    assert kv.block_ids("a") == [1, 2, 3]
    assert kv.check_invariants() == []


def test_a_table_handed_out_is_replaced_never_mutated() -> None:
    """The runner holds ``ids`` lists across a step: every table change assigns a new one."""
    kv = KVCacheManager(8, 4)
    kv.create_table("a", E)
    assert kv.allocate_slots("a", 0, 4) == []
    handed_out = kv.tables["a"].ids
    assert kv.allocate_slots("a", 4, 1) == []  # opens block 2
    assert handed_out == [1] and kv.block_ids("a") == [1, 2]
    assert kv.block_refs("a")[1] == BlockRef(2, kv.pool.blocks[2].epoch)
    handed_out = kv.tables["a"].ids
    kv.fork("a", ["a#0", "a#1"])
    assert kv.allocate_slots("a#0", 5, 1) == [(2, 3)]  # copy on write of the shared block
    assert handed_out == [1, 2] and kv.block_ids("a#0") == [1, 3]
    handed_out = kv.tables["a#1"].ids
    kv.truncate("a#1", 1)
    assert handed_out == [1, 2] and kv.block_ids("a#1") == [1]
    assert kv.check_invariants() == []


def test_allocate_returns_none_without_side_effects_when_dry() -> None:
    kv = KVCacheManager(4, 4)
    kv.create_table("a", E)
    assert kv.allocate_slots("a", 0, 8) == []
    kv.create_table("b", E)
    assert kv.allocate_slots("b", 0, 8) is None
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 1
    assert kv.check_invariants() == []


def test_prefix_hit_pins_blocks_and_leaves_last_token() -> None:
    kv = KVCacheManager(10, 4)
    tokens = list(range(12))
    assert _run(kv, "a", tokens) == 0
    kv.free("a")
    # Blocks 1..3 all sealed; returned tail first.
    assert kv.pool.free_queue.ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    cached = kv.lookup_prefix("b", tokens, E, len(tokens) - 1)
    assert cached == 8  # 12 tokens: at most 11 served -> 2 whole blocks
    assert kv.block_ids("b") == [1, 2]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 0]
    assert kv.pool.free_queue.ids() == [4, 5, 6, 7, 8, 9, 3]
    # An allocation in the same pass cannot evict the pinned prefix.
    kv.create_table("c", E)
    assert kv.allocate_slots("c", 0, 28) == []
    assert kv.block_ids("c") == [4, 5, 6, 7, 8, 9, 3]
    assert kv.block_ids("b") == [1, 2]
    assert kv.prefix_cache_hits == 8 and kv.prefix_cache_queries == 8 + 8
    assert kv.check_invariants() == []


def test_salt_and_exact_token_compare_guard_hits() -> None:
    kv = KVCacheManager(10, 4)
    tokens = list(range(9))
    _run(kv, "a", tokens)
    kv.free("a")
    assert kv.lookup_prefix("b", tokens, encode_extra_keys("model", "tenant"), 8) == 0
    # Forge a collision: the index entry's stored tokens differ -> no hit.
    h = kv.pool.blocks[1].block_hash
    assert h is not None
    kv.pool.blocks[1].token_bytes = pack_block_tokens([99, 99, 99, 99])
    assert kv.lookup_prefix("c", tokens, E, 8) == 0
    kv.pool.blocks[1].token_bytes = pack_block_tokens([0, 1, 2, 3])
    assert kv.lookup_prefix("d", tokens, E, 8) == 8


def test_fork_shares_blocks_and_copies_partial_block_on_write() -> None:
    kv = KVCacheManager(10, 4)
    kv.create_table("p", E)
    prompt = list(range(6))
    kv.allocate_slots("p", 0, 5)  # prompt[:-1]
    kv.seal_full_blocks("p", prompt, 5)
    assert kv.block_ids("p") == [1, 2]
    kv.fork("p", ["p#0", "p#1", "p#2"])
    assert not kv.has_table("p")
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2)] == [3, 3]
    assert kv.check_invariants() == []
    # Child 0 writes position 5 into shared block 2: copy on write.
    assert kv.allocate_slots("p#0", 5, 1) == [(2, 3)]
    assert kv.block_ids("p#0") == [1, 3]
    assert kv.allocate_slots("p#1", 5, 1) == [(2, 4)]
    # The last holder writes in place.
    assert kv.allocate_slots("p#2", 5, 1) == []
    assert kv.block_ids("p#2") == [1, 2]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [3, 1, 1, 1]
    assert kv.check_invariants() == []
    for cid in ("p#0", "p#1", "p#2"):
        kv.free(cid)
    assert kv.pool.num_free_blocks == 9
    assert kv.check_invariants() == []


def test_free_is_idempotent_and_refs_go_stale() -> None:
    kv = KVCacheManager(6, 4)
    kv.create_table("a", E)
    kv.allocate_slots("a", 0, 5)
    refs = kv.block_refs("a")
    assert refs == [BlockRef(1, 0), BlockRef(2, 0)]
    assert kv.resolve(refs[0]).block_id == 1
    kv.free("a")
    kv.free("a")
    kv.free("never-existed")
    assert [kv.pool.blocks[i].epoch for i in (1, 2)] == [1, 1]
    assert kv.pool.num_free_blocks == 5
    with pytest.raises(StaleBlockError, match="epoch"):
        kv.resolve(refs[0])
    kv.create_table("b", E)
    kv.allocate_slots("b", 0, 1)  # block 1 again, new epoch
    assert kv.block_refs("b") == [BlockRef(1, 1)]
    with pytest.raises(StaleBlockError):
        kv.resolve(refs[0])
    assert kv.check_invariants() == []


def test_table_listing_a_block_twice_is_freed_once() -> None:
    kv = KVCacheManager(6, 4)
    kv.create_table("a", E)
    kv.allocate_slots("a", 0, 4)
    entry = kv.tables["a"]
    entry.refs.append(entry.refs[0])
    entry.ids.append(entry.ids[0])
    assert any("twice" in e for e in kv.check_invariants())
    kv.free("a")
    assert kv.pool.blocks[1].ref_cnt == 0
    assert kv.pool.free_queue.ids().count(1) == 1
    assert kv.check_invariants() == []


def test_errors_for_unknown_and_duplicate_tables() -> None:
    kv = KVCacheManager(6, 4)
    kv.create_table("a", E)
    with pytest.raises(DuplicateRequestError):
        kv.create_table("a", E)
    with pytest.raises(DuplicateRequestError):
        kv.lookup_prefix("a", [1, 2], E, 1)
    with pytest.raises(UnknownRequestError):
        kv.block_ids("zzz")


def test_audit_reports_corruption() -> None:
    kv = KVCacheManager(6, 4)
    kv.create_table("a", E)
    kv.allocate_slots("a", 0, 4)
    kv.pool.blocks[1].ref_cnt = 2
    assert any("ref_cnt 2 but 1" in e for e in kv.check_invariants())
    kv.pool.blocks[1].ref_cnt = 1
    kv.pool.blocks[1].epoch = 7
    assert any("stale ref" in e for e in kv.check_invariants())
