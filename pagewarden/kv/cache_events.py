"""Changes of the prefix-cache index, as the block pool records them for outside readers.

A hash enters the index when a full block is sealed under it (``BlockStored``) and
leaves it when the block holding it is evicted for reuse or quarantined
(``BlockRemoved``). Replaying the events in order from an empty index gives exactly the
pool's ``hash_index`` keys: that is the invariant ``engine/kv_events.py`` publishes on,
for routers that track which replica caches which prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagewarden.kv.block import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """``block_hash`` now indexes a full block holding ``token_ids``; ``parent_hash`` is
    the hash of the block before it in its chain (None for a chain's first block)."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """``block_hash`` no longer indexes any block."""

    block_hash: BlockHash


CacheEvent = BlockStored | BlockRemoved
