"""The scheduler's invariants, checked on demand (tests after every operation, the
engine every ``audit_interval`` steps); the KV manager's are checked with them."""

from __future__ import annotations

from pagewarden.sched.request import Request, RequestStatus
from pagewarden.sched.state import SchedulerState


def check_invariants(sched: SchedulerState) -> list[str]:
    """Scheduler + KV invariant violations; empty when sound."""
    errors = sched.kv.check_invariants()
    queues: dict[RequestStatus, list[Request]] = {
        RequestStatus.RUNNING: list(sched.running),
        RequestStatus.WAITING: list(sched.waiting),
        RequestStatus.SWAPPED: list(sched.swapped),
    }
    errors += _queue_errors(sched, queues)
    errors += _shared_open_block_errors(sched)
    for r in sched.requests.values():
        if not 0 <= r.num_computed_tokens <= r.num_tokens:
            errors.append(
                f"{r.req_id}: num_computed_tokens {r.num_computed_tokens} "
                f"outside [0, {r.num_tokens}]"
            )
        if r.all_token_ids != r.prompt_token_ids + r.output_token_ids:
            errors.append(f"{r.req_id}: all_token_ids out of step with prompt + output")
    return errors


def _queue_errors(sched: SchedulerState, queues: dict[RequestStatus, list[Request]]) -> list[str]:
    """A live request is in exactly one queue, with that queue's status; running
    requests hold a device table, swapped ones a host table, waiting ones neither."""
    errors: list[str] = []
    seen: dict[str, RequestStatus] = {}
    for status, queue in queues.items():
        ids = [r.req_id for r in queue]
        if len(set(ids)) != len(ids):
            errors.append(f"a request is listed twice in {status.value}")
        for r in queue:
            if r.req_id in seen and seen[r.req_id] is not status:
                errors.append(f"{r.req_id} is both {seen[r.req_id].value} and {status.value}")
            seen[r.req_id] = status
            if r.status is not status:
                errors.append(f"{r.req_id} in {status.value} with status {r.status.name}")
    if set(seen) != set(sched.requests):
        errors.append(
            f"live requests {sorted(sched.requests)} != running+waiting+swapped {sorted(seen)}"
        )
    running = sorted(r.req_id for r in queues[RequestStatus.RUNNING])
    if sorted(sched.kv.tables) != running:
        errors.append(f"block tables {sorted(sched.kv.tables)} != running requests {running}")
    swapped = sorted(r.req_id for r in queues[RequestStatus.SWAPPED])
    if sorted(sched.kv.swap.tables) != swapped:
        errors.append(
            f"swapped tables {sorted(sched.kv.swap.tables)} != swapped requests {swapped}"
        )
    return errors


def _shared_open_block_errors(sched: SchedulerState) -> list[str]:
    """Only fork children share a partly filled block: prefix hits share full blocks
    only, so anyone else appending to a shared block would write another's KV."""
    errors: list[str] = []
    bs = sched.config.block_size
    blocks = sched.kv.pool.blocks
    for r in sched.running:
        entry = sched.kv.tables.get(r.req_id)
        index = r.num_computed_tokens // bs
        if (
            r.parent_id is not None
            or not r.num_computed_tokens % bs
            or entry is None
            or index >= len(entry.refs)
        ):
            continue
        ref = entry.refs[index]
        block = blocks[ref.block_id]
        if block.epoch == ref.epoch and block.ref_cnt != 1:  # (a stale ref is its own fault)
            errors.append(
                f"{r.req_id}: partly filled block {ref.block_id} is shared "
                f"(ref_cnt {block.ref_cnt}) but it is no fork child"
            )
    return errors
