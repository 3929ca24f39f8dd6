"""The scheduler's journal: every state-changing call, as the flight recorder keeps it.

While ``Scheduler.journal`` is a list, each public mutator appends one tuple, after its
owner check and (where replay compares a result) after it ran. The tuples hold live
objects (no copy on the hot path) that are never mutated afterwards; ``encode`` turns
one into the JSON object of a flight record (``docs/flight-recorder.md``)::

    tuple appended                             JSON "op"  what replay does with it
    ("add", request)                           add        add_request(same prompt/params)
    ("finish", ids, status, reason, stop)      finish     finish_requests_as(...)
    ("limits", max_num_seqs, max_tokens)       limits     set_batch_limits(...)
    ("verify", events)                         verify     verify_block_tables(); compare
    schedule_entry(out, tables)                schedule   schedule(); compare the step
    ("update", req_ids, sampled)               update     update(those requests, tokens)
    ("recover", faults, report)                recover    recover(faults); compare report
    ("repair", report)                         repair     repair(); compare report
    ("release", block_ids)                     release    release_quarantined(block_ids)
    ("mode", mode)                             mode       set_preemption_mode(mode)
    ("drop_cached", count)                     drop_cached drop_cached_prefixes(); compare
    ("external", name, args)                   external   a metadata change made outside
                                                          the scheduler (fault injection)
    ("tier", "loading", req_id, bool)          tier       the answers of the KV tiers'
    ("tier", "extend", req_id, n | None)       tier       loads (``sched/tier_prefix.py``),
    ("tier", "wait", bool)                     tier       fed back to the next schedule()

A scheduled step records each request's table as (block_id, epoch) pairs at schedule
time: the table the worker was told to read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, fields
from itertools import chain
from typing import Any

from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.output import KVFault, SchedulerOutput
from pagewarden.sched.recovery import RecoveryReport
from pagewarden.sched.request import Request

#: The first line of a flight record names its format and version; a reader refuses
#: other versions (bump on any change to a line's meaning, see docs/flight-recorder.md).
RECORD_FORMAT = "pagewarden-flight-record"
RECORD_VERSION = 1

#: SamplingParams fields the constructor takes (``stop_strings`` is derived).
_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.init)


def encode(op: tuple) -> dict[str, Any]:
    """One journal tuple as a JSON-ready dict."""
    kind = op[0]
    if kind == "add":
        return {"op": "add", **encode_arrival(op[1])}
    if kind == "finish":
        _, req_ids, status, reason, stop_reason = op
        return {
            "op": "finish",
            "req_ids": list(req_ids),
            "status": status.value,
            "reason": reason,
            "stop_reason": stop_reason,
        }
    if kind == "limits":
        return {"op": "limits", "max_num_seqs": op[1], "max_num_batched_tokens": op[2]}
    if kind == "verify":
        return {
            "op": "verify",
            "events": [[e.kind, e.req_id, e.block_id, e.position] for e in op[1]],
        }
    if kind == "schedule":
        _, step, (rids, starts, counts, tables), copies, swap_out, swap_in, preempted, departed = op
        return {
            "op": "schedule",
            "step": step,
            "requests": [
                [rid, start, n, list(refs[0::2]), list(refs[1::2])]
                for rid, start, n, refs in zip(rids, starts, counts, tables)
            ],
            "copy_blocks": copies,
            "swap_out": swap_out,
            "swap_in": swap_in,
            "preempted": preempted,
            "departed": departed,
        }
    if kind == "update":
        return {"op": "update", "req_ids": op[1], "sampled": op[2]}
    if kind == "recover":
        return {
            "op": "recover",
            "faults": [encode_fault(f) for f in op[1]],
            "report": encode_report(op[2]),
        }
    if kind == "repair":
        return {"op": "repair", "report": encode_report(op[1])}
    if kind == "release":
        return {"op": "release", "block_ids": op[1]}
    if kind == "mode":
        return {"op": "mode", "mode": op[1]}
    if kind == "drop_cached":
        return {"op": "drop_cached", "dropped": op[1]}
    if kind == "external":
        return {"op": "external", "name": op[1], "args": list(op[2])}
    if kind == "tier":
        return {"op": "tier", "call": op[1], "args": list(op[2:])}
    raise ValueError(f"unknown journal entry {kind!r}")


def schedule_entry(
    out: SchedulerOutput, tables: Mapping[str, Any], cache: dict[str, tuple[list[int], tuple]]
) -> tuple:
    """The journal entry of a scheduled step: four columns, one row per request (req_id,
    first position, num_tokens, table as ``(block_id, epoch, block_id, epoch, ...)``),
    then the copies, swaps and departures (encoded per request as ``[req_id, first
    position, num_tokens, block_ids, epochs]``).

    Flat tuples of ints and strings only, not the step's objects nor ``BlockRef``s (a
    tuple subclass the garbage collector never untracks): hundreds of steps of them add
    nothing for the collector to walk. A table's refs list grows in place, so it is
    copied to keep this step's epochs; but a table's ``ids`` list is replaced whenever
    the table changes, so ``cache`` (req_id -> (ids, copy), kept by the caller, pruned
    here to this step's requests) reuses the copy of a table that did not change.
    """
    rids, starts, counts, copies = [], [], [], []
    seen: dict[str, tuple[list[int], tuple]] = {}
    for r in out.requests:
        rid = r.req_id
        entry = tables[rid]
        hit = cache.get(rid)
        if hit is None or hit[0] is not entry.ids:
            hit = (entry.ids, tuple(chain.from_iterable(entry.refs)))
        seen[rid] = hit
        rids.append(rid)
        starts.append(r.positions.start)
        counts.append(len(r.positions))
        copies.append(hit[1])
    cache.clear()
    cache.update(seen)
    return (
        "schedule",
        out.step_id,
        (tuple(rids), tuple(starts), tuple(counts), tuple(copies)),
        tuple(out.copy_blocks),
        tuple((w.src, w.dst, w.num_slots) for w in out.swap_out),
        tuple((w.src, w.dst, w.num_slots) for w in out.swap_in),
        tuple(out.preempted_req_ids),
        tuple(out.finished_req_ids),
    )


def encode_params(params: SamplingParams) -> dict[str, Any]:
    d = asdict(params)
    return {k: d[k] for k in _PARAM_FIELDS}


def decode_params(d: dict[str, Any]) -> SamplingParams:
    bias = d.get("logit_bias")
    if bias:  # JSON object keys are strings; the token ids are ints
        d = {**d, "logit_bias": {int(k): v for k, v in bias.items()}}
    return SamplingParams(**d)


def encode_arrival(req: Request) -> dict[str, Any]:
    """What ``add_request`` was given: the fields a new ``Request`` is built from."""
    return {
        "req_id": req.req_id,
        "prompt_token_ids": list(req.prompt_token_ids),
        "sampling_params": encode_params(req.sampling_params),
        "eos_token_ids": sorted(req.eos_token_ids),
        "cache_salt": req.cache_salt,
    }


def decode_arrival(d: dict[str, Any]) -> Request:
    """A new ``Request`` from ``encode_arrival``'s fields (other keys are ignored)."""
    return Request(
        d["req_id"],
        d["prompt_token_ids"],
        decode_params(d["sampling_params"]),
        eos_token_ids=frozenset(d["eos_token_ids"]),
        cache_salt=d["cache_salt"],
    )


def encode_fault(f: KVFault) -> dict[str, Any]:
    return {
        "kind": f.kind,
        "block_ids": list(f.block_ids),
        "rollback": f.rollback,
        "found_by": f.found_by,
        "detail": f.detail,
    }


def decode_fault(d: dict[str, Any]) -> KVFault:
    return KVFault(
        d["kind"], tuple(d["block_ids"]), dict(d["rollback"]), d["found_by"], d["detail"]
    )


def encode_report(r: RecoveryReport) -> dict[str, Any]:
    return {
        "quarantined": list(r.quarantined),
        "rolled_back": r.rolled_back,
        "recomputed_tokens": r.recomputed_tokens,
        "failed": list(r.failed),
    }
