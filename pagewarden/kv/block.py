"""One physical KV block's metadata, and the epoch-tagged reference block tables hold."""

from __future__ import annotations

import enum
from typing import NamedTuple, NewType

BlockId = NewType("BlockId", int)
BlockHash = NewType("BlockHash", bytes)

#: Block 0 is never handed out: padding writes (slot 0..block_size-1) land there.
RESERVED_BLOCK_ID = BlockId(0)


class BlockState(enum.Enum):
    FREE = "free"  # ref_cnt == 0, no hash, in the free queue
    USED = "used"  # ref_cnt > 0
    CACHED_FREE = "cached_free"  # ref_cnt == 0, carries a hash, in the free queue (evictable)
    QUARANTINED = "quarantined"  # suspect content: never handed out until released
    RESERVED = "reserved"  # block 0 only


class BlockRef(NamedTuple):
    """A block-table entry: valid only while ``epoch`` equals the block's current epoch."""

    block_id: BlockId
    epoch: int


class KVBlock:
    """Metadata of one physical block.

    Invariants (checked by ``audit.check_invariants``):
    - ``ref_cnt`` equals the number of block tables referencing the block;
    - ``epoch`` is bumped every time the block returns to the free state, so every
      ``BlockRef`` taken before that fails to resolve;
    - ``block_hash`` is set at most once per allocation, only when the block is full, and
      ``token_bytes`` then holds exactly the block's tokens, packed (for the exact compare
      on a hit);
    - ``prev_free``/``next_free`` link the block into the free queue iff its state is FREE
      or CACHED_FREE.
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "epoch",
        "block_hash",
        "parent_hash",
        "token_bytes",
        "checksum",
        "state",
        "prev_free",
        "next_free",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = BlockId(block_id)
        self.ref_cnt = 0
        self.epoch = 0
        self.block_hash: BlockHash | None = None
        # The chain hash of the block before it (None at the root), set with block_hash:
        # a block offloaded to a KV tier carries it (kvstore/format.py).
        self.parent_hash: BlockHash | None = None
        # The tokens in prefix_hash.pack_block_tokens' encoding (one small bytes object:
        # cheap to keep and to drop at eviction).
        self.token_bytes: bytes | None = None
        self.checksum: int | None = None
        self.state = BlockState.FREE
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return (
            f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, epoch={self.epoch}, "
            f"state={self.state.name}, hashed={self.block_hash is not None})"
        )
