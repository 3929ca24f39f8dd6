"""Changes of the prefix-cache index, as the block pool records them for outside readers.

A hash enters the index when a full block is sealed under it (``BlockStored``) and
leaves it when the block holding it is evicted for reuse or quarantined
(``BlockRemoved``). Replaying the events in order from an empty index gives exactly the
pool's ``hash_index`` keys (the events of medium "GPU"; KV tiers add their own, with
their medium): that is the invariant ``engine/kv_events.py`` publishes on,
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
    # Where the block now is: "GPU" (vLLM's name for the engine's own pool, on every
    # device), "DISK" or "REDIS" (a KV tier, kvstore/).
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """``block_hash`` no longer indexes any block (in ``medium``)."""

    block_hash: BlockHash
    medium: str = "GPU"


CacheEvent = BlockStored | BlockRemoved
