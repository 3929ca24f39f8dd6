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
    ("schedule", out, refs)                    schedule   schedule(); compare the step
    ("update", req_ids, sampled)               update     update(those requests, tokens)
    ("recover", faults, report)                recover    recover(faults); compare report
    ("repair", report)                         repair     repair(); compare report
    ("release", block_ids)                     release    release_quarantined(block_ids)
    ("external", name, args)                   external   a metadata change made outside
                                                          the scheduler (fault injection)

``refs`` is the (block_id, epoch) list of each scheduled request's table at schedule
time: the table as the worker was told to read it.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.output import KVFault, SchedulerOutput
from pagewarden.sched.recovery import RecoveryReport

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
        req = op[1]
        return {
            "op": "add",
            "req_id": req.req_id,
            "prompt_token_ids": req.prompt_token_ids,
            "sampling_params": encode_params(req.sampling_params),
            "eos_token_ids": sorted(req.eos_token_ids),
            "cache_salt": req.cache_salt,
        }
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
        return {"op": "schedule", **encode_schedule(op[1], op[2])}
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
    if kind == "external":
        return {"op": "external", "name": op[1], "args": list(op[2])}
    raise ValueError(f"unknown journal entry {kind!r}")


def encode_schedule(out: SchedulerOutput, refs: list[tuple]) -> dict[str, Any]:
    """What a step scheduled: per request ``[req_id, first position, num_tokens,
    [[block_id, epoch], ...]]``, plus the copies, swaps and departures."""
    return {
        "step": out.step_id,
        "requests": [
            [r.req_id, r.positions.start, len(r.positions), [list(ref) for ref in table]]
            for r, table in zip(out.requests, refs)
        ],
        "copy_blocks": [list(c) for c in out.copy_blocks],
        "swap_out": [[w.src, w.dst, w.num_slots] for w in out.swap_out],
        "swap_in": [[w.src, w.dst, w.num_slots] for w in out.swap_in],
        "preempted": list(out.preempted_req_ids),
        "departed": list(out.finished_req_ids),
    }


def encode_params(params: SamplingParams) -> dict[str, Any]:
    d = asdict(params)
    return {k: d[k] for k in _PARAM_FIELDS}


def decode_params(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**d)


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
