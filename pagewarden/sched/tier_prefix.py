"""Prefix hits beyond the pool: extend a request's cached prefix from the KV tiers.

After the pool's own prefix lookup stops at block ``first``, the next blocks of the
request's chain are looked up in the tiers (``kvstore.store.TierStore.load``, which
verifies every entry against the chain: model, layout, chain and parent hash, token ids,
checksum)::

    blocks   0 .. first-1      first .. first+n-1          first+n ..
             pool hits         loaded from a tier          computed in this step
             (pinned)          (fresh blocks, TierLoad)

Loaded blocks count as computed; the runner copies them into their pool blocks before
the forward pass and checks them there once more. Nothing here touches bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagewarden.kv.block import BlockHash
from pagewarden.kv.block_pool import EvictedBlock
from pagewarden.kv.kv_manager import KVCacheManager
from pagewarden.kv.prefix_hash import hash_and_pack_block
from pagewarden.kvstore.format import BlockIdentity
from pagewarden.kvstore.store import LoadedBlock
from pagewarden.sched.output import SchedulerOutput, TierLoad
from pagewarden.sched.request import Request

LoadFn = Callable[[Sequence[BlockIdentity]], list[LoadedBlock]]


class TierPrefix:
    """Extends prefix hits from the tiers, at most ``max_blocks`` blocks per request."""

    def __init__(self, load: LoadFn, max_blocks: int = 1024) -> None:
        self.load = load
        self.max_blocks = max_blocks

    def extend(
        self, kv: KVCacheManager, req: Request, cached: int, max_tokens: int
    ) -> tuple[int, list[TierLoad]]:
        """``req`` (with a table holding ``cached`` pool-hit tokens) extended by tier
        blocks, up to ``max_tokens`` tokens: the new cached count and the loads."""
        bs = kv.block_size
        first = cached // bs
        last = min(max(0, max_tokens) // bs, first + self.max_blocks)
        if first >= last:
            return cached, []
        tokens = req.all_token_ids
        hashes = kv.tables[req.req_id].hashes
        parent: BlockHash | None = hashes[first - 1] if first else None
        chain: list[BlockIdentity] = []
        for i in range(first, last):
            h, packed = hash_and_pack_block(parent, tokens[i * bs : (i + 1) * bs], req.extra_keys)
            chain.append(BlockIdentity(h, parent, packed))
            parent = h
        loaded = self.load(chain)
        if not loaded:
            return cached, []
        if kv.allocate_slots(req.req_id, cached, len(loaded) * bs) is None:
            return cached, []  # no room: the request computes them instead
        ids = kv.tables[req.req_id].ids
        loads = [
            TierLoad(ids[first + j], b.payload, b.checksum, req.req_id, first + j, b.tier, b.key)
            for j, b in enumerate(loaded)
        ]
        return cached + len(loaded) * bs, loads


def with_tier_io(
    out: SchedulerOutput, evicted: list[EvictedBlock], loads: list[TierLoad]
) -> SchedulerOutput:
    """``out`` carrying the step's evicted blocks and tier loads."""
    return SchedulerOutput(
        out.step_id,
        out.requests,
        out.copy_blocks,
        out.finished_req_ids,
        out.preempted_req_ids,
        out.swap_out,
        out.swap_in,
        evicted,
        loads,
    )
