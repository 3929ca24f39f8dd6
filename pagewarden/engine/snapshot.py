"""What the dashboard shows of the engine: one picture of KV and requests, between steps.

``take_snapshot(core)`` runs on the engine-core thread, between two steps, when the HTTP
process asked for one (``core_proc.py`` takes at most one per ``MIN_INTERVAL_S``); the
result is pickled through the pipe and served as JSON by ``server/dashboard.py``. It is
shaped as the page reads it, so the HTTP side copies it and never reshapes it.

The block map is one letter per physical block, index = block id::

    R reserved (block 0)     F free                U used by one request
    C cached-free (free,     S shared (used by     Q quarantined
      prefix content kept)     several requests)   X retired (quarantined for good)

Cost: one pass over the pool and one over the block tables (``bench/dashboard_snapshot.py``
measures it against a step at batch 64).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagewarden.kv.block import BlockState

#: The core takes a snapshot at most this often, however often it is asked.
MIN_INTERVAL_S = 0.5
#: Requests listed per queue (running, waiting, swapped); the counts cover them all.
MAX_LISTED_REQUESTS = 256


@dataclass(frozen=True)
class RequestView:
    """One request as the dashboard lists it."""

    id: str
    status: str  # running | waiting | swapped
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int  # tokens whose K/V is in the cache
    blocks: int  # device blocks its table holds (host blocks when swapped)
    preemptions: int
    # Whose request it is: its prefix-cache salt (one per API key; None without keys).
    # The dashboard shows a tenant only its own requests by it and never sends it out.
    tenant: str | None = None


@dataclass(frozen=True)
class EventView:
    """One integrity detection (``engine.integrity.IntegrityRecord``)."""

    time: float
    step: int
    kind: str
    found_by: str
    blocks: list[int]
    rolled_back: dict[str, int]  # request -> position it recomputes from
    detail: str


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's KV cache and queues at one point between steps."""

    taken_at: float  # wall clock
    cost_s: float  # time taking this snapshot took on the engine-core thread
    step: int
    block_size: int
    blocks: str  # one letter per device block (see the module docstring)
    holders: dict[int, list[str]]  # block id -> requests whose tables hold it
    quarantines: dict[int, int]  # block id -> times it was quarantined (0 omitted)
    host_blocks: str  # one letter per host (swap) block: F free, U holds a swapped request
    host_holders: dict[int, str]  # host block id -> the swapped request holding it
    num_running: int
    num_waiting: int
    num_swapped: int
    requests: list[RequestView]  # running, then waiting, then swapped
    events: list[EventView]  # newest first


def take_snapshot(core) -> EngineSnapshot:
    """The dashboard's picture of ``core`` (an ``EngineCore``); engine-core thread only."""
    start = time.perf_counter()
    sched = core.scheduler
    kv = sched.kv
    pool = kv.pool
    letters = []
    append = letters.append
    # Identity tests, most frequent states first: an enum lookup in a dict costs a
    # Python-level __hash__ per block.
    free, used, cached = BlockState.FREE, BlockState.USED, BlockState.CACHED_FREE
    for block in pool.blocks:
        state = block.state
        if state is free:
            append("F")
        elif state is used:
            append("S" if block.ref_cnt > 1 else "U")
        elif state is cached:
            append("C")
        elif state is BlockState.QUARANTINED:
            append("X" if block.block_id in pool.retired else "Q")
        else:
            append("R")
    holders: dict[int, list[str]] = {}
    for req_id, entry in kv.tables.items():
        for block_id in set(entry.ids):
            holders.setdefault(block_id, []).append(req_id)
    host = ["F"] * kv.swap.num_blocks
    host_holders: dict[int, str] = {}
    for req_id, table in kv.swap.tables.items():
        for host_id in table.host_ids:
            host[host_id] = "U"
            host_holders[host_id] = req_id
    requests = [
        _request_view(req, status, kv)
        for status, queue in (
            ("running", sched.running),
            ("waiting", sched.waiting),
            ("swapped", sched.swapped),
        )
        for req, _ in zip(queue, range(MAX_LISTED_REQUESTS))
    ]
    events = [
        EventView(
            e.time, e.step, e.kind, e.found_by, list(e.block_ids), dict(e.rolled_back), e.detail
        )
        for e in reversed(core.integrity.events)
    ]
    return EngineSnapshot(
        taken_at=time.time(),
        cost_s=time.perf_counter() - start,
        step=sched.num_steps,
        block_size=pool.block_size,
        blocks="".join(letters),
        holders=holders,
        quarantines=dict(pool.failure_counts),
        host_blocks="".join(host),
        host_holders=host_holders,
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_swapped=len(sched.swapped),
        requests=requests,
        events=events,
    )


def _request_view(req, status: str, kv) -> RequestView:
    if status == "swapped":
        table = kv.swap.tables.get(req.req_id)
        blocks = len(table.host_ids) if table is not None else 0
    else:
        entry = kv.tables.get(req.req_id)
        blocks = len(entry.ids) if entry is not None else 0
    return RequestView(
        id=req.req_id,
        status=status,
        prompt_tokens=req.num_prompt_tokens,
        output_tokens=len(req.output_token_ids),
        computed_tokens=req.num_computed_tokens,
        blocks=blocks,
        preemptions=req.num_preemptions,
        tenant=req.cache_salt,
    )
