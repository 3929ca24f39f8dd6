"""Token-budget continuous batching with chunked prefill, prefix caching and preemption.

One rule covers every request: each step closes, under ``max_num_batched_tokens`` and
``max_num_seqs``, the gap between its ``num_computed_tokens`` and
``num_computable_tokens`` (all its tokens; ``prompt[:-1]`` for a fork parent), with one
``allocate_slots`` call per request. A decode is a gap of one token; a prefill chunk,
a recompute after preemption and a rollback after a fault are larger gaps.

Per step: running requests first, in order (when the pool runs dry the most recently
admitted one is preempted, see ``preemption.py``); then, if nothing was preempted,
swapped requests come back, and only when none is left swapped are waiting requests
admitted, in order, after a prefix-cache lookup. Beside decodes, a step's prefill
tokens may be capped below the budget, and full-budget prefill steps are spaced
(``prefill_cap.py``: small prefill work is chunked at half the decode count).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from pagewarden.kv.kv_manager import KVCacheManager
from pagewarden.kv.swap_space import BlockSwap
from pagewarden.sched import invariants, preemption, recovery
from pagewarden.sched.admission import AdmissionLimits, RequestRejected, check_request
from pagewarden.sched.config import SchedulerConfig
from pagewarden.sched.journal import schedule_entry
from pagewarden.sched.output import (
    KVFault,
    ModelRunnerOutput,
    RequestUpdate,
    SchedulerOutput,
    TierLoad,
    TokenLogprobs,
)
from pagewarden.sched.plan import StepPlan, needs_prompt_logprobs, prefill_cap
from pagewarden.sched.recovery import IntegrityEvent, RecoveryReport
from pagewarden.sched.request import Request, RequestStatus, stop_token_set
from pagewarden.sched.state import scheduler_stats
from pagewarden.sched.stats import SchedulerStats
from pagewarden.sched.tier_prefix import TierPrefix, with_tier_io

__all__ = ["Scheduler"]

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_SWAPPED = RequestStatus.SWAPPED


class Scheduler:
    """Owns the waiting, running and swapped queues and (through ``kv``) every block table.

    Invariants (``check_invariants``): a request is live iff it is in exactly one of
    ``waiting``/``running``/``swapped``; running requests hold a device block table,
    swapped ones a host table, waiting ones neither;
    ``0 <= num_computed_tokens <= num_tokens``; plus the KV invariants.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.num_host_blocks,
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        # Fork parent id -> ids of its live children (so aborting the parent reaches them).
        self.children: dict[str, set[str]] = {}
        # Handed to the runner with the next step (see ``SchedulerOutput``).
        self.departed_ids: list[str] = []  # finished, aborted or preempted since the last step
        self.preempted_ids: list[str] = []
        self.swap_out: list[BlockSwap] = []
        self.swap_in: list[BlockSwap] = []
        # KV tiers (``enable_kv_tiers``): prefix hits beyond the pool, and their loads.
        self.tier_prefix: TierPrefix | None = None
        self.tier_loads: list[TierLoad] = []
        self.num_steps = 0
        self.last_group_step: int | None = None  # see prefill_cap.py
        self.group_wait_since: int | None = None
        self.group_wait_work = self.group_grew_at = 0
        self.num_preemptions = 0
        # Effective per-step limits: the configured ones, or lower while the engine's
        # batch controller holds the batch down (see ``set_batch_limits``).
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        # The flight recorder's journal (``sched/journal.py``): each state-changing call
        # appends its inputs, and the result replay compares; None when not recording.
        self.journal: list[tuple] | None = None
        self._journal_tables: dict[str, tuple[list[int], tuple]] = {}
        # The configured preemption mode, or "recompute" while a profile turns swapping off.
        self.preemption_mode = config.preemption_mode

    def enable_kv_tiers(self, tier_prefix: TierPrefix) -> None:
        """Offload evicted cached blocks (``SchedulerOutput.offload``) and extend prefix
        hits from the tiers (``SchedulerOutput.tier_loads``)."""
        self.kv.pool.check_owner()
        self.tier_prefix = tier_prefix
        tier_prefix.journal_of = lambda: self.journal  # its answers, for replay
        self.kv.pool.evicted = []

    def set_preemption_mode(self, mode: str) -> None:
        """Preempt by ``"recompute"`` or ``"swap"`` from now on; requests already in the
        host tier come back either way."""
        self.kv.pool.check_owner()
        if mode not in ("recompute", "swap"):
            raise ValueError(f"preemption mode must be 'recompute' or 'swap', got {mode!r}")
        if mode == "swap" and not self.config.num_host_blocks:
            raise ValueError("preemption mode 'swap' needs host blocks (num_host_blocks)")
        self.preemption_mode = mode
        if self.journal is not None:
            self.journal.append(("mode", mode))

    def drop_cached_prefixes(self) -> int:
        """Forget the prefix-cache entries of every block nobody holds (safe mode's
        "reuse only what was verified since"); returns how many were dropped."""
        dropped = self.kv.pool.drop_cached()
        if self.journal is not None:
            self.journal.append(("drop_cached", dropped))
        return dropped

    def set_batch_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Lower (or restore) the per-step limits, between 1 and the configured ones.

        Running requests are never dropped: past a lowered seat limit they wait for
        seats, and no new request is admitted until the running batch fits under it.
        """
        self.kv.pool.check_owner()
        cfg = self.config
        if not 1 <= max_num_seqs <= cfg.max_num_seqs:
            raise ValueError(f"max_num_seqs must be in [1, {cfg.max_num_seqs}], got {max_num_seqs}")
        if not 1 <= max_num_batched_tokens <= cfg.max_num_batched_tokens:
            raise ValueError(
                f"max_num_batched_tokens must be in [1, {cfg.max_num_batched_tokens}], "
                f"got {max_num_batched_tokens}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        if self.journal is not None:
            self.journal.append(("limits", max_num_seqs, max_num_batched_tokens))

    # ------------------------------------------------------------- admission
    def usable_blocks(self) -> int:
        """Blocks one request may hold: all but block 0 and the retired ones."""
        return self.config.num_blocks - 1 - len(self.kv.pool.retired)

    def admission_limits(self, vocab_size: int | None = None) -> AdmissionLimits:
        """The limits ``check_request`` applies to a request for this scheduler now."""
        c = self.config
        limits = (c.max_model_len, c.block_size, self.usable_blocks(), c.max_num_seqs)
        return AdmissionLimits(*limits, vocab_size)

    def add_request(self, request: Request) -> None:
        """Queue ``request``; raises ``RequestRejected`` if it can never be served."""
        self.kv.pool.check_owner()
        rid = request.req_id
        if rid in self.requests or rid in self.children:
            raise RequestRejected(f"request id {rid!r} is already in use")
        params = request.sampling_params
        request.max_tokens = check_request(
            request.prompt_token_ids, params, self.admission_limits()
        )
        request.stop_ids = stop_token_set(params, request.eos_token_ids)
        preemption.set_rope(self.config, request)
        request.seed = params.seed
        request.status = _WAITING
        if self.journal is not None:
            self.journal.append(("add", request))
        if request.is_fork_parent and request.num_prompt_tokens == 1:
            # prompt[:-1] is empty: nothing to share, the children start on their own.
            children = request.make_children()
            self.children[rid] = {c.req_id for c in children}
            for child in children:
                self.requests[child.req_id] = child
                self.waiting.append(child)
            return
        self.requests[rid] = request
        self.waiting.append(request)

    # ---------------------------------------------------------- abort/finish
    def abort_requests(self, req_ids: Iterable[str]) -> None:
        """Abort requests (a fork parent's id aborts all its children); unknown ids ignored."""
        self.finish_requests_as(req_ids, RequestStatus.FINISHED_ABORTED, "abort")

    def finish_requests(self, req_ids: Iterable[str], stop_reason: str | None) -> None:
        """The engine found a stop string: finish these requests with reason "stop"."""
        self.finish_requests_as(req_ids, RequestStatus.FINISHED_STOPPED, "stop", stop_reason)

    def finish_requests_as(
        self,
        req_ids: Iterable[str],
        status: RequestStatus,
        reason: str,
        stop_reason: int | str | None = None,
    ) -> None:
        """Finish live requests (and a fork parent's children) wherever they are queued."""
        self.kv.pool.check_owner()
        req_ids = list(req_ids)
        if self.journal is not None:
            self.journal.append(("finish", req_ids, status, reason, stop_reason))
        self._finish_unjournaled(req_ids, status, reason, stop_reason)
        self.kv.reconcile_after_free()  # counted; the engine logs it

    def _finish_unjournaled(
        self,
        req_ids: list[str],
        status: RequestStatus,
        reason: str,
        stop_reason: int | str | None = None,
    ) -> None:
        """``finish_requests_as`` for a call that another journaled one makes (recovery
        failing the requests it cannot serve): replaying that call finishes them again."""
        for rid in req_ids:
            for tid in [rid, *sorted(self.children.get(rid, ()))]:
                req = self.requests.get(tid)
                if req is None:
                    continue
                if req.status is _WAITING:
                    self.waiting.remove(req)
                elif req.status is _SWAPPED:
                    self.swapped.remove(req)
                else:
                    self.running.remove(req)
                self._finish(req, status, reason, stop_reason)

    def _finish(
        self, req: Request, status: RequestStatus, reason: str, stop_reason: int | str | None
    ) -> None:
        """Mark finished, free blocks (full ones stay cached); caller unlinks the queues."""
        req.status = status
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.kv.free(req.req_id)
        if self.tier_prefix is not None:  # a load in flight is dropped (no block held)
            self.tier_prefix.forget(req.req_id)
        del self.requests[req.req_id]
        self.departed_ids.append(req.req_id)
        pid = req.parent_id
        if pid is not None and pid in self.children:
            live = self.children[pid]
            live.discard(req.req_id)
            if not live:
                del self.children[pid]

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocate their slots."""
        self.kv.pool.check_owner()
        self.num_steps += 1
        evicted = self.kv.pool.evicted
        if evicted:  # evicted outside a schedule (none expected): possibly overwritten
            evicted.clear()
        preemption.restart_past_rope_switch(self)  # before the cap: a restart is a prefill
        plan = StepPlan(self.max_num_batched_tokens, prefill_cap(self))
        self._schedule_running(plan)
        if not plan.preempted:  # a pool that just ran dry admits nobody new
            if self.swapped:
                preemption.schedule_swapped(self, plan)
            if not self.swapped:  # swapped requests come back before new ones start
                self._schedule_waiting(plan)
                # Nothing to run but tier loads in flight: wait for one, do not spin.
                if not plan.requests and self.tier_prefix and self.tier_prefix.wait(0.02):
                    self._schedule_waiting(plan)
        handed = (self.departed_ids, self.preempted_ids, self.swap_out, self.swap_in)
        dead = self.kv.pool.take_dead()
        out = SchedulerOutput(self.num_steps, plan.requests, plan.copies, *handed, dead_blocks=dead)
        self.departed_ids, self.preempted_ids, self.swap_out, self.swap_in = [], [], [], []
        if evicted is not None:
            out = with_tier_io(out, evicted, self.tier_loads)
            self.kv.pool.evicted, self.tier_loads = [], []
        if self.journal is not None:
            self.journal.append(schedule_entry(out, self.kv.tables, self._journal_tables))
        return out

    def _schedule_running(self, plan: StepPlan) -> None:
        """Schedule running requests in order, preempting from the back when the pool
        runs dry."""
        max_seqs = self.max_num_seqs
        # Preemption pops from the back of ``running``; the iterator stops short of it.
        for req in self.running:
            if plan.budget <= 0 or len(plan.requests) >= max_seqs:
                break
            num_new = plan.grant(req.num_computable_tokens - req.num_computed_tokens)
            if num_new <= 0:
                continue
            copies = self._allocate_or_preempt(req, num_new, plan)
            if copies is None:
                break
            plan.copies.extend(copies)
            plan.add(req, num_new, self.kv.tables[req.req_id].ids, self.config.block_size)

    def _allocate_or_preempt(
        self, req: Request, num_new: int, plan: StepPlan
    ) -> list[tuple[int, int]] | None:
        """Allocate ``req``'s slots, preempting from the back of ``running`` until they
        fit; returns the copy-on-write pairs, or None once ``req`` itself was preempted."""
        while True:
            copies = self.kv.allocate_slots(req.req_id, req.num_computed_tokens, num_new)
            if copies is not None:
                return copies
            victim = self.running.pop()
            preemption.preempt(self, victim)
            plan.preempted = True
            if victim is req:
                return None

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in order while the budget, the seats and the free blocks
        last; each starts after its cached prefix."""
        kv, tiers = self.kv, self.tier_prefix
        max_seqs = self.max_num_seqs
        i = 0  # requests whose tier load is in flight wait in place; the others go on
        while (
            i < len(self.waiting)
            and min(plan.budget, plan.prefill_left) > 0
            and len(self.running) < max_seqs
            and len(plan.requests) < max_seqs
        ):
            req = self.waiting[i]
            if tiers is not None and tiers.is_loading(req.req_id):
                i += 1
                continue
            preemption.set_rope(self.config, req)  # it may have grown past the switch
            target = req.num_computable_tokens
            # A request that still has prompt logprobs to report computes its whole
            # prompt: a cached prefix would skip the positions it must score.
            reuse = 0 if needs_prompt_logprobs(req) else target - 1
            cached = kv.lookup_prefix(req.req_id, req.all_token_ids, req.extra_keys, reuse)
            loads: list[TierLoad] | None = []
            if tiers is not None and kv.enable_prefix_caching and reuse:
                extended = tiers.extend(kv, req, cached, reuse)
                cached, loads = extended if extended is not None else (cached, None)
            num_new = plan.grant(target - cached)
            copies = None if loads is None else kv.allocate_slots(req.req_id, cached, num_new)
            if copies is None:
                kv.free(req.req_id)  # unpin the prefix we looked up (and loaded)
                if loads is None:  # its load just started: it waits
                    i += 1
                    continue
                break
            if tiers is not None:
                tiers.forget(req.req_id)
                self.tier_loads.extend(loads or ())
            del self.waiting[i]
            if req.num_preemptions == 0:
                req.num_cached_tokens = min(cached, req.num_prompt_tokens)
            req.num_computed_tokens = cached
            req.status = _RUNNING
            self.running.append(req)
            plan.copies.extend(copies)
            plan.add(req, num_new, kv.tables[req.req_id].ids, self.config.block_size)

    # ---------------------------------------------------------------- update
    def update(self, out: SchedulerOutput, res: ModelRunnerOutput) -> list[RequestUpdate]:
        """Advance requests by what the step computed; append sampled tokens; finish/fork.

        Returns one ``RequestUpdate`` per sampled token, in step order. A scheduled
        request that finished, was aborted or was preempted since ``schedule`` is skipped.
        """
        self.kv.pool.check_owner()
        if self.journal is not None:
            req_ids = tuple([r.req_id for r in out.requests])
            self.journal.append(("update", req_ids, res.sampled_token_ids))
        updates: list[RequestUpdate] = []
        forked: dict[str, list[Request]] = {}
        for sr in out.requests:
            req = self.requests.get(sr.req_id)
            if req is None or req.status is not _RUNNING:
                continue  # finished or aborted since this step was scheduled
            if sr.positions.start != req.num_computed_tokens:
                continue  # preempted (or rolled back) and rescheduled since: stale
            req.num_computed_tokens = sr.positions.stop
            self.kv.seal_full_blocks(req.req_id, req.all_token_ids, req.num_computed_tokens)
            if sr.sample:
                token = res.sampled_token_ids[sr.req_id]
                updates.append(self._append_token(req, token, res.logprobs))
            elif req.is_fork_parent and req.num_computed_tokens == req.num_computable_tokens:
                forked[req.req_id] = self._fork(req)
        if forked or any(u.finished for u in updates):
            self._drop_finished_and_forked(forked)
        return updates

    def _append_token(
        self, req: Request, token: int, logprobs: dict[str, TokenLogprobs]
    ) -> RequestUpdate:
        """Append ``token`` to ``req``; finish it on a stop token or a length limit."""
        req.append_output_token(token)
        n_out = len(req.output_token_ids)
        # Below max_tokens means below max_model_len too (checked at admission).
        finished = n_out >= req.max_tokens or (
            token in req.stop_ids and n_out >= req.sampling_params.min_tokens
        )
        if finished:
            self._finish_sampled(req, token)
        lp = logprobs.get(req.req_id)
        return RequestUpdate(
            req_id=req.req_id,
            parent_id=req.parent_id,
            index=req.index,
            new_token_ids=[token],
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            logprobs=[lp] if lp is not None else [],
        )

    def _finish_sampled(self, req: Request, token: int) -> None:
        """Finish ``req``, whose just-sampled ``token`` stopped it or hit a length limit."""
        params = req.sampling_params
        status, reason = RequestStatus.FINISHED_LENGTH, "length"
        stop_reason: int | str | None = None
        if len(req.output_token_ids) >= params.min_tokens:
            if token in (params.stop_token_ids or ()):
                status, reason, stop_reason = RequestStatus.FINISHED_STOPPED, "stop", token
            elif not params.ignore_eos and token in req.eos_token_ids:
                status, reason = RequestStatus.FINISHED_STOPPED, "stop"
        self._finish(req, status, reason, stop_reason)

    def _drop_finished_and_forked(self, forked: dict[str, list[Request]]) -> None:
        """Rebuild ``running`` without finished requests, forked parents by their children."""
        new_running: list[Request] = []
        for r in self.running:
            if r.status is _RUNNING:
                new_running.extend(forked.get(r.req_id, (r,)))
        self.running = new_running

    def _fork(self, parent: Request) -> list[Request]:
        """Replace a parent that has computed ``prompt[:-1]`` by its ``n`` children."""
        children = parent.make_children()
        self.kv.fork(parent.req_id, [c.req_id for c in children])
        del self.requests[parent.req_id]
        self.children[parent.req_id] = {c.req_id for c in children}
        for child in children:
            child.status = _RUNNING
            self.requests[child.req_id] = child
        self.departed_ids.append(parent.req_id)
        return children

    # --------------------------------------------------------------- queries
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def stats(self) -> SchedulerStats:
        return scheduler_stats(self)

    def check_invariants(self) -> list[str]:
        """Scheduler + KV invariant violations; empty when sound."""
        return invariants.check_invariants(self)

    # ------------------------------------------------------------- integrity
    def claim_ownership(self) -> None:
        """Make the calling thread the only one allowed to mutate scheduler and KV state."""
        self.kv.pool.claim_ownership()

    def verify_block_tables(self) -> list[IntegrityEvent]:
        """Roll back every running request whose table names a freed or altered block.

        Run before ``schedule()``: such an entry would let the request read (and write
        into) a block that now belongs to someone else (see ``recovery.py``).
        """
        self.kv.pool.check_owner()
        events = recovery.verify_block_tables(self)
        if self.journal is not None:
            self.journal.append(("verify", events))
        return events

    def recover(self, faults: list[KVFault]) -> RecoveryReport:
        """Quarantine the failed blocks and roll back every request that holds one."""
        self.kv.pool.check_owner()
        report = recovery.recover(self, faults)
        if self.journal is not None:
            self.journal.append(("recover", list(faults), report))
        return report

    def repair(self) -> RecoveryReport:
        """Recover from metadata an invariant audit found inconsistent (``recovery.py``)."""
        self.kv.pool.check_owner()
        report = recovery.repair(self)
        if self.journal is not None:
            self.journal.append(("repair", report))
        return report

    def quarantined_block_ids(self) -> list[int]:
        """Quarantined blocks nobody holds and not retired: ready to scrub and release."""
        return recovery.quarantined_block_ids(self)

    def release_quarantined(self, block_ids: Iterable[int]) -> None:
        """Return scrubbed and re-verified blocks to service."""
        self.kv.pool.check_owner()
        block_ids = list(block_ids)
        if self.journal is not None:
            self.journal.append(("release", block_ids))
        for block_id in block_ids:
            self.kv.pool.release_quarantine(block_id)
