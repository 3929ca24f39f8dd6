"""Preemption and swapping: what happens when the pool runs dry, and how requests return.

The victim is always the most recently admitted running request (the back of
``running``). With ``preemption_mode="recompute"`` its blocks are freed, its progress is
forgotten and it goes to the front of ``waiting``. With ``"swap"`` its KV is copied to
the host tier instead (when the host tier has room and there is KV to keep): it goes to
the front of ``swapped`` and resumes where it stopped once its blocks fit again. Swapped
requests come back before any waiting request is admitted.

The copies themselves are the worker's: ``swap_out``/``swap_in`` collect them for the
step's ``SchedulerOutput`` (swap-outs before the forward pass, so the freed device blocks
can be handed to others in the same step).
"""

from __future__ import annotations

from pagewarden.kv.prefix_hash import encode_extra_keys
from pagewarden.sched.config import SchedulerConfig
from pagewarden.sched.plan import StepPlan
from pagewarden.sched.request import Request, RequestStatus
from pagewarden.sched.state import SchedulerState


def preempt(sched: SchedulerState, req: Request) -> None:
    """Swap ``req`` out to the host tier (swap mode, room there, KV to keep), else
    recompute: free its blocks, forget its progress, put it at the front of waiting.
    The caller has already removed it from ``running``."""
    req.num_preemptions += 1
    sched.num_preemptions += 1
    sched.preempted_ids.append(req.req_id)
    sched.departed_ids.append(req.req_id)
    if sched.preemption_mode == "swap" and req.num_computed_tokens:
        swaps = sched.kv.swap_out(req.req_id, req.num_computed_tokens)
        if swaps is not None:
            sched.swap_out.extend(swaps)
            req.status = RequestStatus.SWAPPED
            sched.swapped.appendleft(req)
            return
    sched.kv.free(req.req_id)
    req.num_computed_tokens = 0
    req.status = RequestStatus.WAITING
    sched.waiting.appendleft(req)


def set_rope(config: SchedulerConfig, req: Request) -> None:
    """Pick ``req``'s RoPE factor set from its length (``rope_switch_tokens``) and the
    prefix-cache keys that go with it: KV rotated with the long set is hashed apart."""
    switch = config.rope_switch_tokens
    req.rope_long = switch is not None and req.num_tokens > switch
    rope = "long" if req.rope_long else None
    req.extra_keys = encode_extra_keys(config.model_id, req.cache_salt, rope=rope)


def restart_past_rope_switch(sched: SchedulerState) -> None:
    """Restart each running request that grew past ``rope_switch_tokens`` on the short
    RoPE factors: transformers then computes the whole sequence again with the long ones,
    so its KV is dropped and recomputed, as a recompute preemption does (the runner
    forgets its state the same way) without counting one."""
    switch = sched.config.rope_switch_tokens
    if switch is None:
        return
    for req in [r for r in sched.running if not r.rope_long and r.num_tokens > switch]:
        sched.running.remove(req)
        _restart(sched, req)


def _restart(sched: SchedulerState, req: Request) -> None:
    """Drop ``req``'s KV and put it at the front of waiting to compute every token again.
    The caller has removed it from ``running``."""
    req.num_preemptions += 1  # not a first admission: its prompt's cache count stays
    sched.preempted_ids.append(req.req_id)
    sched.departed_ids.append(req.req_id)
    sched.kv.free(req.req_id)
    req.num_computed_tokens = 0
    req.status = RequestStatus.WAITING
    sched.waiting.appendleft(req)


def schedule_swapped(sched: SchedulerState, plan: StepPlan) -> None:
    """Swap requests back in, in order, while the budget, the seats and the free blocks
    last, and schedule their next tokens."""
    kv = sched.kv
    bs = sched.config.block_size
    max_seqs = sched.max_num_seqs
    while (
        sched.swapped
        and plan.budget > 0
        and len(sched.running) < max_seqs
        and len(plan.requests) < max_seqs
    ):
        req = sched.swapped[0]
        start = req.num_computed_tokens
        num_new = plan.grant(req.num_computable_tokens - start)
        # Its blocks come back and this step's tokens need room too (fresh, private
        # blocks: no copy on write).
        if (start + max(num_new, 0) + bs - 1) // bs > kv.num_free_blocks:
            break
        swaps = kv.swap_in(req.req_id)
        assert swaps is not None, "free blocks were counted above"
        sched.swap_in.extend(swaps)
        sched.swapped.popleft()
        req.status = RequestStatus.RUNNING
        sched.running.append(req)
        if num_new <= 0:
            continue
        cow = kv.allocate_slots(req.req_id, start, num_new)
        assert cow == [], f"{req.req_id}: swapped-in blocks are private, got {cow}"
        plan.add(req, num_new, kv.tables[req.req_id].ids, bs)
