"""Prefix hits beyond the pool: extend a request's cached prefix from the KV tiers.

After the pool's own prefix lookup stops at block ``first``, the next blocks of the
request's chain are loaded from the tiers asynchronously (``kvstore/loader.py``: a
loader thread reads and verifies every entry against the chain: model, layout, chain and
parent hash, token ids, checksum). Until the load is done the request waits: it is not
scheduled, and the rest of the batch steps on. Then it is admitted like any other::

    blocks   0 .. first-1      first .. first+n-1          first+n ..
             pool hits         loaded from a tier          computed in this step
             (pinned)          (fresh blocks, TierLoad)

Loaded blocks count as computed; the runner copies them into their pool blocks and
checks them there once more before the forward pass of the step that admits the
request. A waiting request holds no pool block (only the host copies of its load), so
aborting it frees nothing but the load. Nothing here touches bytes.

Loads finish when the tiers answer, so what ``is_loading``, ``extend`` and ``wait``
return depends on timing: with the flight recorder on (``journal_of`` returns the
scheduler's journal) each answer is journaled as a ``("tier", call, ...)`` entry, and
``pagewarden replay`` feeds the recorded answers back (``ReplayTierPrefix`` in
``sched/replay.py``) instead of asking a tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagewarden.kv.block import BlockHash
from pagewarden.kv.block_pool import EvictedBlock
from pagewarden.kv.kv_manager import KVCacheManager
from pagewarden.kv.prefix_hash import hash_and_pack_block
from pagewarden.kvstore.format import BlockIdentity
from pagewarden.kvstore.loader import LoadJob
from pagewarden.sched.output import SchedulerOutput, TierLoad
from pagewarden.sched.request import Request

StartFn = Callable[[Sequence[BlockIdentity]], LoadJob]
WaitFn = Callable[[Sequence[LoadJob], float], None]


@dataclass
class _Pending:
    job: LoadJob
    first: int  # the logical index of the chain's first block


class TierPrefix:
    """Extends prefix hits from the tiers, at most ``max_blocks`` blocks per request.

    ``pending`` holds one load per waiting request that asked the tiers; it is dropped
    when the request is admitted or leaves (``forget``)."""

    def __init__(self, start: StartFn, wait: WaitFn, max_blocks: int = 1024) -> None:
        self.start = start
        self.wait_for = wait
        self.max_blocks = max_blocks
        self.pending: dict[str, _Pending] = {}
        # The scheduler's journal while the flight recorder runs (set by the scheduler).
        self.journal_of: Callable[[], list[tuple] | None] = lambda: None

    def _note(self, *op: object) -> None:
        journal = self.journal_of()
        if journal is not None:
            journal.append(("tier", *op))

    def is_loading(self, req_id: str) -> bool:
        """True while ``req_id``'s tier load is in flight (it must not be scheduled)."""
        p = self.pending.get(req_id)
        loading = p is not None and not p.job.ready()
        self._note("loading", req_id, loading)
        return loading

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a load to finish; False when none is in flight."""
        jobs = [p.job for p in self.pending.values() if not p.job.done.is_set()]
        if jobs:
            self.wait_for(jobs, timeout_s)
        self._note("wait", bool(self.pending))
        return bool(self.pending)

    def forget(self, req_id: str) -> None:
        """``req_id`` was admitted or left: drop (and stop) its load."""
        p = self.pending.pop(req_id, None)
        if p is not None:
            p.job.cancel()

    def extend(
        self, kv: KVCacheManager, req: Request, cached: int, max_tokens: int
    ) -> tuple[int, list[TierLoad]] | None:
        """``req`` (with a table holding ``cached`` pool-hit tokens) extended by tier
        blocks, up to ``max_tokens`` tokens: the new cached count and the loads; None
        while its load is in flight (a first call starts it). Journaled as the number of
        loaded blocks it tried to place (None: in flight)."""
        found = self._extend(kv, req, cached, max_tokens)
        self._note("extend", req.req_id, None if found is None else found[1])
        return None if found is None else found[0]

    def _extend(
        self, kv: KVCacheManager, req: Request, cached: int, max_tokens: int
    ) -> tuple[tuple[int, list[TierLoad]], int] | None:
        """``extend``'s answer and the number of loaded blocks it tried to place."""
        bs = kv.block_size
        first = cached // bs
        last = min(max(0, max_tokens) // bs, first + self.max_blocks)
        p = self.pending.get(req.req_id)
        if p is not None and first < p.first:  # pool blocks evicted since: no join
            self.forget(req.req_id)
            p = None
        if p is None:
            if first >= last:
                return (cached, []), 0
            self.pending[req.req_id] = _Pending(
                self.start(self._chain(kv, req, first, last)), first
            )
            return None
        if not p.job.ready():
            return None
        # The pool may hold more of the chain now than when the load was issued.
        loaded = p.job.result()[first - p.first : last - p.first]
        if not loaded or kv.allocate_slots(req.req_id, cached, len(loaded) * bs) is None:
            # Nothing to add, or no room: computed instead (or later).
            return (cached, []), len(loaded)
        ids = kv.tables[req.req_id].ids
        loads = [
            TierLoad(ids[first + j], b.payload, b.checksum, req.req_id, first + j, b.tier, b.key)
            for j, b in enumerate(loaded)
        ]
        return (cached + len(loaded) * bs, loads), len(loaded)

    @staticmethod
    def _chain(kv: KVCacheManager, req: Request, first: int, last: int) -> list[BlockIdentity]:
        """The identities of ``req``'s logical blocks ``first .. last-1``."""
        bs = kv.block_size
        tokens = req.all_token_ids
        parent: BlockHash | None = kv.tables[req.req_id].hashes[first - 1] if first else None
        chain: list[BlockIdentity] = []
        for i in range(first, last):
            h, packed = hash_and_pack_block(parent, tokens[i * bs : (i + 1) * bs], req.extra_keys)
            chain.append(BlockIdentity(h, parent, packed))
            parent = h
        return chain


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
        out.dead_blocks,
    )
