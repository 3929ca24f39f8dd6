"""Foreign-thread mutations: every public mutator of the scheduler and the KV metadata,
called with plausible arguments, and a fingerprint of the state they must leave alone.

Used by the ``foreign_thread`` fault (one call per injection, round robin) and by the
tests that call every mutator from a second thread while the engine steps::

    before = state_fingerprint(scheduler)
    error = call_from_thread(call.fn)           # KVOwnershipError, or None if it ran
    assert state_fingerprint(scheduler) == before
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagewarden.kv.block import BlockHash
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.output import ModelRunnerOutput, SchedulerOutput
from pagewarden.sched.request import Request, RequestStatus


@dataclass(frozen=True)
class ForeignCall:
    """One public mutator and a closure calling it with arguments taken from live state."""

    owner: str  # "Scheduler", "KVCacheManager", "BlockPool" or "SwapSpace"
    method: str
    fn: Callable[[], Any]


def foreign_calls(scheduler) -> list[ForeignCall]:
    """Every public mutator of ``scheduler``, its ``KVCacheManager``, ``BlockPool`` and
    ``SwapSpace``, each bound to arguments that would change state if the call ran."""
    kv = scheduler.kv
    pool, swap = kv.pool, kv.swap
    running = [r for r in scheduler.running if r.req_id in kv.tables]
    rid = running[0].req_id if running else "none"
    req = running[0] if running else None
    n = req.num_computed_tokens if req is not None else 0
    tokens = req.all_token_ids if req is not None else [5, 6, 7]
    held = pool.blocks[kv.tables[rid].ids[0]] if rid in kv.tables and kv.tables[rid].ids else None
    block = held if held is not None else pool.blocks[1]
    swapped = next(iter(swap.tables), rid)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    calls = _scheduler_calls(scheduler, rid, block.block_id, params)
    calls += _kv_calls(kv, rid, n, tokens, block, swapped)
    return [ForeignCall(owner, method, fn) for owner, method, fn in calls]


_Call = tuple[str, str, Callable[[], Any]]


def _scheduler_calls(scheduler, rid: str, block_id: int, params: SamplingParams) -> list[_Call]:
    """The scheduler's public mutators, aimed at request ``rid`` and block ``block_id``."""
    empty_out = SchedulerOutput(step_id=0, requests=[])
    return [
        (
            "Scheduler",
            "add_request",
            lambda: scheduler.add_request(Request("foreign", [5, 6, 7], params)),
        ),
        ("Scheduler", "abort_requests", lambda: scheduler.abort_requests([rid])),
        ("Scheduler", "finish_requests", lambda: scheduler.finish_requests([rid], None)),
        (
            "Scheduler",
            "finish_requests_as",
            lambda: scheduler.finish_requests_as([rid], RequestStatus.FINISHED_ABORTED, "abort"),
        ),
        ("Scheduler", "schedule", scheduler.schedule),
        ("Scheduler", "set_batch_limits", lambda: scheduler.set_batch_limits(1, 1)),
        ("Scheduler", "enable_kv_tiers", lambda: scheduler.enable_kv_tiers(None)),
        (
            "Scheduler",
            "set_preemption_mode",
            lambda: scheduler.set_preemption_mode(
                "recompute" if scheduler.preemption_mode == "swap" else "swap"
            ),
        ),
        ("Scheduler", "drop_cached_prefixes", scheduler.drop_cached_prefixes),
        ("Scheduler", "update", lambda: scheduler.update(empty_out, ModelRunnerOutput({}))),
        ("Scheduler", "verify_block_tables", scheduler.verify_block_tables),
        ("Scheduler", "recover", lambda: scheduler.recover([])),
        ("Scheduler", "repair", scheduler.repair),
        (
            "Scheduler",
            "release_quarantined",
            lambda: scheduler.release_quarantined([block_id]),
        ),
        ("Scheduler", "claim_ownership", scheduler.claim_ownership),
    ]


def _kv_calls(kv, rid: str, n: int, tokens: list[int], block, swapped: str) -> list[_Call]:
    """The public mutators of the KV manager, its pool and its host tier."""
    pool, swap = kv.pool, kv.swap
    return [
        ("KVCacheManager", "lookup_prefix", lambda: kv.lookup_prefix("foreign", tokens, b"", 64)),
        ("KVCacheManager", "create_table", lambda: kv.create_table("foreign", b"")),
        ("KVCacheManager", "allocate_slots", lambda: kv.allocate_slots(rid, n, 64)),
        (
            "KVCacheManager",
            "seal_full_blocks",
            lambda: kv.seal_full_blocks(rid, tokens, len(tokens)),
        ),
        ("KVCacheManager", "fork", lambda: kv.fork(rid, ["foreign#0", "foreign#1"])),
        ("KVCacheManager", "free", lambda: kv.free(rid)),
        ("KVCacheManager", "swap_out", lambda: kv.swap_out(rid, n)),
        ("KVCacheManager", "swap_in", lambda: kv.swap_in(swapped)),
        ("KVCacheManager", "truncate", lambda: kv.truncate(rid, 0)),
        ("KVCacheManager", "reconcile", kv.reconcile),
        ("KVCacheManager", "reconcile_after_free", kv.reconcile_after_free),
        ("BlockPool", "claim_ownership", pool.claim_ownership),
        ("BlockPool", "get_new_blocks", lambda: pool.get_new_blocks(1)),
        ("BlockPool", "touch", lambda: pool.touch([block])),
        ("BlockPool", "free_blocks", lambda: pool.free_blocks([block])),
        (
            "BlockPool",
            "seal",
            lambda: pool.seal(block, BlockHash(b"foreign"), [0] * pool.block_size),
        ),
        ("BlockPool", "drop_cached", pool.drop_cached),
        ("BlockPool", "quarantine", lambda: pool.quarantine(block.block_id)),
        ("BlockPool", "release_quarantine", lambda: pool.release_quarantine(block.block_id)),
        ("BlockPool", "reconcile", lambda: pool.reconcile([0] * pool.num_blocks)),
        ("BlockPool", "take_cache_events", pool.take_cache_events),
        ("BlockPool", "take_dead", pool.take_dead),
        ("SwapSpace", "allocate", lambda: swap.allocate(1)),
        ("SwapSpace", "release", lambda: swap.release([0])),
    ]


def call_from_thread(fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn`` on a new thread; returns what it raised (None if it returned)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed back to the caller, who judges it
            raised.append(exc)

    thread = threading.Thread(target=run, name="pagewarden-foreign")
    thread.start()
    thread.join()
    return raised[0] if raised else None


def state_fingerprint(scheduler) -> tuple:
    """Everything a mutator could change, as comparable plain values."""
    kv = scheduler.kv
    pool, swap = kv.pool, kv.swap
    blocks = tuple(
        (b.block_id, b.ref_cnt, b.epoch, b.state, b.block_hash, b.prev_free is not None)
        for b in pool.blocks
    )
    tables = tuple(
        (rid, tuple(e.refs), tuple(e.ids), e.num_sealed) for rid, e in sorted(kv.tables.items())
    )
    swapped = tuple((rid, tuple(t.host_ids)) for rid, t in sorted(swap.tables.items()))
    queues = tuple(
        tuple((r.req_id, r.num_computed_tokens, len(r.output_token_ids)) for r in q)
        for q in (scheduler.running, scheduler.waiting, scheduler.swapped)
    )
    return (
        blocks,
        tuple(pool.free_queue.ids()),
        tuple(sorted((h, b.block_id) for h, b in pool.hash_index.items())),
        tuple(sorted(pool.quarantined)),
        pool.owner_thread,
        tables,
        tuple(swap._free),
        swapped,
        queues,
        tuple(sorted(scheduler.requests)),
        scheduler.preemption_mode,
    )
