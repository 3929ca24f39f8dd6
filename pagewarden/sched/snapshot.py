"""A checkpoint of scheduler and KV metadata, as JSON-ready data, and a scheduler rebuilt
from one.

The flight recorder takes a checkpoint at the start of its window so that replay can
start mid-run: ``restore(capture(s))`` is a scheduler whose next calls behave exactly
as ``s``'s would (same queues and request progress, same block tables with their
epochs, same pool: block states, ref counts, hashes, free-queue order, hash index,
quarantine, host tier, counters). No K/V, no tensors: metadata only.

Bytes (prefix hashes, packed block tokens, extra keys) are hex strings.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pagewarden.kv.block import BlockHash, BlockId, BlockRef, BlockState
from pagewarden.kv.block_table import RequestBlocks
from pagewarden.kv.kv_manager import KVCacheManager
from pagewarden.kv.swap_space import BlockSwap, SwappedTable
from pagewarden.sched.config import SchedulerConfig
from pagewarden.sched.journal import decode_arrival, encode_arrival
from pagewarden.sched.request import Request, RequestStatus
from pagewarden.sched.scheduler import Scheduler

_POOL_COUNTERS = (
    "num_allocations",
    "num_frees",
    "num_evictions",
    "ownership_violations",
    "held_blocks_skipped",
    "held_blocks_found_at_free",
)
_KV_COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "stale_refs_dropped",
    "refcounts_fixed_at_free",
)


def capture(sched: Scheduler) -> dict[str, Any]:
    """The scheduler's and its KV manager's state, JSON-ready."""
    swaps = (
        [[w.src, w.dst, w.num_slots] for w in sched.swap_out],
        [[w.src, w.dst, w.num_slots] for w in sched.swap_in],
    )
    return {
        "config": asdict(sched.config),
        "num_steps": sched.num_steps,
        "last_group_step": sched.last_group_step,
        "group_wait_since": sched.group_wait_since,
        "group_wait_work": sched.group_wait_work,
        "group_grew_at": sched.group_grew_at,
        "num_preemptions": sched.num_preemptions,
        "max_num_seqs": sched.max_num_seqs,
        "preemption_mode": sched.preemption_mode,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "requests": [_capture_request(r) for r in sched.requests.values()],
        "waiting": [r.req_id for r in sched.waiting],
        "running": [r.req_id for r in sched.running],
        "swapped": [r.req_id for r in sched.swapped],
        "children": {pid: sorted(ids) for pid, ids in sched.children.items()},
        "departed_ids": list(sched.departed_ids),
        "preempted_ids": list(sched.preempted_ids),
        "swap_out": swaps[0],
        "swap_in": swaps[1],
        "kv": _capture_kv(sched.kv),
    }


def restore(state: dict[str, Any]) -> Scheduler:
    """A new scheduler in the state ``capture`` recorded (owned by nobody yet)."""
    sched = Scheduler(SchedulerConfig(**state["config"]))
    sched.num_steps = state["num_steps"]
    sched.last_group_step = state.get("last_group_step")
    sched.group_wait_since = state.get("group_wait_since")
    sched.group_wait_work = state.get("group_wait_work", 0)
    sched.group_grew_at = state.get("group_grew_at", 0)
    sched.num_preemptions = state["num_preemptions"]
    sched.max_num_seqs = state["max_num_seqs"]
    sched.preemption_mode = state["preemption_mode"]
    sched.max_num_batched_tokens = state["max_num_batched_tokens"]
    for d in state["requests"]:
        req = _restore_request(d)
        sched.requests[req.req_id] = req
    reqs = sched.requests
    sched.waiting.extend(reqs[rid] for rid in state["waiting"])
    sched.running.extend(reqs[rid] for rid in state["running"])
    sched.swapped.extend(reqs[rid] for rid in state["swapped"])
    sched.children = {pid: set(ids) for pid, ids in state["children"].items()}
    sched.departed_ids = list(state["departed_ids"])
    sched.preempted_ids = list(state["preempted_ids"])
    sched.swap_out = [BlockSwap(*w) for w in state["swap_out"]]
    sched.swap_in = [BlockSwap(*w) for w in state["swap_in"]]
    _restore_kv(sched.kv, state["kv"])
    return sched


def _capture_request(r: Request) -> dict[str, Any]:
    return {
        **encode_arrival(r),
        "output_token_ids": list(r.output_token_ids),
        "num_computed_tokens": r.num_computed_tokens,
        "status": r.status.value,
        "finish_reason": r.finish_reason,
        "stop_reason": r.stop_reason,
        "parent_id": r.parent_id,
        "index": r.index,
        "num_cached_tokens": r.num_cached_tokens,
        "max_tokens": r.max_tokens,
        "seed": r.seed,
        "extra_keys": r.extra_keys.hex(),
        "rope_long": r.rope_long,
        "num_preemptions": r.num_preemptions,
        "stop_ids": sorted(r.stop_ids),
    }


def _restore_request(d: dict[str, Any]) -> Request:
    req = decode_arrival(d)
    for token in d["output_token_ids"]:
        req.append_output_token(token)
    req.num_computed_tokens = d["num_computed_tokens"]
    req.status = RequestStatus(d["status"])
    req.finish_reason = d["finish_reason"]
    req.stop_reason = d["stop_reason"]
    req.parent_id = d["parent_id"]
    req.index = d["index"]
    req.num_cached_tokens = d["num_cached_tokens"]
    req.max_tokens = d["max_tokens"]
    req.seed = d["seed"]
    req.extra_keys = bytes.fromhex(d["extra_keys"])
    req.rope_long = d.get("rope_long", False)
    req.num_preemptions = d["num_preemptions"]
    req.stop_ids = frozenset(d["stop_ids"])
    return req


def _hex(b: bytes | None) -> str | None:
    return None if b is None else b.hex()


def _unhex(s: str | None) -> bytes | None:
    return None if s is None else bytes.fromhex(s)


def _capture_kv(kv: KVCacheManager) -> dict[str, Any]:
    pool = kv.pool
    swap = kv.swap
    return {
        # [ref_cnt, epoch, state, block_hash, token_bytes, checksum], indexed by block id
        "blocks": [
            [b.ref_cnt, b.epoch, b.state.value, _hex(b.block_hash), _hex(b.token_bytes), b.checksum]
            for b in pool.blocks
        ],
        "free_queue": pool.free_queue.ids(),
        "hash_index": [[h.hex(), b.block_id] for h, b in pool.hash_index.items()],
        "quarantined": sorted(pool.quarantined),
        "failure_counts": sorted([b, n] for b, n in pool.failure_counts.items()),
        "retired": sorted(pool.retired),
        "pool_counters": {name: getattr(pool, name) for name in _POOL_COUNTERS},
        "counters": {name: getattr(kv, name) for name in _KV_COUNTERS},
        "tables": [
            {
                "req_id": rid,
                "refs": [list(r) for r in e.refs],
                "ids": list(e.ids),
                "hashes": [h.hex() for h in e.hashes],
                "num_sealed": e.num_sealed,
                "extra_keys": e.extra_keys.hex(),
                "miss": None if e.miss is None else [e.miss[0], e.miss[1].hex()],
            }
            for rid, e in kv.tables.items()
        ],
        "host_free": list(swap._free),
        "host_tables": [
            {
                "req_id": rid,
                "host_ids": list(t.host_ids),
                "hashes": [h.hex() for h in t.hashes],
                "extra_keys": t.extra_keys.hex(),
                "num_tokens": t.num_tokens,
            }
            for rid, t in swap.tables.items()
        ],
        "host_counters": [swap.num_swapped_out, swap.num_swapped_in],
    }


def _restore_kv(kv: KVCacheManager, d: dict[str, Any]) -> None:
    pool = kv.pool
    if len(d["blocks"]) != pool.num_blocks:
        raise ValueError(f"checkpoint has {len(d['blocks'])} blocks, the config {pool.num_blocks}")
    for block, (ref_cnt, epoch, state, block_hash, token_bytes, checksum) in zip(
        pool.blocks, d["blocks"]
    ):
        block.ref_cnt = ref_cnt
        block.epoch = epoch
        block.state = BlockState(state)
        block.block_hash = None if block_hash is None else BlockHash(bytes.fromhex(block_hash))
        block.token_bytes = _unhex(token_bytes)
        block.checksum = checksum
        block.prev_free = block.next_free = None
    pool.free_queue.reset([pool.blocks[i] for i in d["free_queue"]])
    pool.hash_index = {BlockHash(bytes.fromhex(h)): pool.blocks[b] for h, b in d["hash_index"]}
    pool.quarantined = {BlockId(b) for b in d["quarantined"]}
    pool.failure_counts = {b: n for b, n in d["failure_counts"]}
    pool.retired = {BlockId(b) for b in d["retired"]}
    for name, value in d["pool_counters"].items():
        setattr(pool, name, value)
    for name, value in d["counters"].items():
        setattr(kv, name, value)
    for t in d["tables"]:
        entry = RequestBlocks(bytes.fromhex(t["extra_keys"]))
        entry.refs = [BlockRef(BlockId(b), e) for b, e in t["refs"]]
        entry.ids = list(t["ids"])
        entry.hashes = [BlockHash(bytes.fromhex(h)) for h in t["hashes"]]
        entry.num_sealed = t["num_sealed"]
        entry.miss = None if t["miss"] is None else (t["miss"][0], bytes.fromhex(t["miss"][1]))
        kv.tables[t["req_id"]] = entry
    swap = kv.swap
    swap._free = list(d["host_free"])
    for t in d["host_tables"]:
        swap.tables[t["req_id"]] = SwappedTable(
            list(t["host_ids"]),
            [BlockHash(bytes.fromhex(h)) for h in t["hashes"]],
            bytes.fromhex(t["extra_keys"]),
            t["num_tokens"],
        )
    swap.num_swapped_out, swap.num_swapped_in = d["host_counters"]
