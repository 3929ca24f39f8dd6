"""``kv/audit.check_invariants``: each rule, broken on purpose, reports its violation
(one pass over the blocks checks every per-block rule; each must still fire)."""

from __future__ import annotations

from pagewarden.kv import BlockPool, BlockState
from pagewarden.kv.audit import check_invariants
from pagewarden.kv.block import BlockRef
from pagewarden.kv.prefix_hash import hash_block_tokens


def _pool() -> tuple[BlockPool, dict[str, list[BlockRef]]]:
    """Blocks 1-2 held by request "a", block 3 cached free, block 4 quarantined."""
    pool = BlockPool(8, 4)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    pool.seal(b3, hash_block_tokens(None, [1, 2, 3, 4], b""), [1, 2, 3, 4])
    pool.free_blocks([b4, b3])
    pool.quarantine(4)
    return pool, {"a": [BlockRef(b1.block_id, b1.epoch), BlockRef(b2.block_id, b2.epoch)]}


def test_a_sound_pool_has_no_violation() -> None:
    pool, tables = _pool()
    assert check_invariants(pool, tables) == []


def test_each_broken_rule_is_reported() -> None:
    cases = {
        "block 1: ref_cnt 2 but 1 references held": lambda p, t: setattr(p.blocks[1], "ref_cnt", 2),
        "block 2 is USED with ref_cnt 0": lambda p, t: (
            setattr(p.blocks[2], "ref_cnt", 0),
            t.__setitem__("a", t["a"][:1]),
        ),
        "block 5 is FREE with ref_cnt 1": lambda p, t: setattr(p.blocks[5], "ref_cnt", 1),
        "block 5 is FREE but carries a hash": lambda p, t: (
            setattr(p.blocks[5], "block_hash", b"x"),
            setattr(p.blocks[5], "token_bytes", b"y"),
        ),
        "block 3 is CACHED_FREE without a hash": lambda p, t: (
            setattr(p.blocks[3], "block_hash", None),
            setattr(p.blocks[3], "token_bytes", None),
        ),
        "block 3: hash and stored tokens disagree": lambda p, t: setattr(
            p.blocks[3], "token_bytes", None
        ),
        "block 6 is RESERVED; only block 0 may be": lambda p, t: setattr(
            p.blocks[6], "state", BlockState.RESERVED
        ),
        "conservation: block 0 must be the one reserved block": lambda p, t: setattr(
            p.blocks[6], "state", BlockState.RESERVED
        ),
        "block 4 has ref_cnt 0 but is not in the free queue": lambda p, t: (
            setattr(p.blocks[4], "state", BlockState.FREE),
            p.quarantined.discard(4),
        ),
        "quarantine set [4] != quarantined states []": lambda p, t: setattr(
            p.blocks[4], "state", BlockState.FREE
        ),
        "table 'a' holds stale ref to block 1 (epoch 0, block at 5)": lambda p, t: setattr(
            p.blocks[1], "epoch", 5
        ),
        "table 'b' lists invalid block 9": lambda p, t: t.__setitem__("b", [BlockRef(9, 0)]),
        "free queue holds block 2 in state USED": lambda p, t: (p.free_queue.append(p.blocks[2]),),
    }
    for message, corrupt in cases.items():
        pool, tables = _pool()
        corrupt(pool, tables)
        assert message in check_invariants(pool, tables), message
