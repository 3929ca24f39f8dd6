"""Token-budget continuous batching with chunked prefill, prefix caching and preemption.

Each step closes, under ``max_num_batched_tokens`` and ``max_num_seqs``, the gap between
each request's ``num_computed_tokens`` and its target (``num_tokens``; ``prompt[:-1]``
for an ``n > 1`` parent that has not forked yet). Running requests go first (decode and
unfinished prefill chunks), then waiting ones are admitted in order. When the pool runs
dry, the most recently admitted running request is preempted: by recompute (its blocks
are freed, ``num_computed_tokens = 0``, it goes to the front of the waiting queue) or, with
``preemption_mode="swap"``, by swapping its KV out to the host tier (it goes to the front
of the swapped queue and resumes where it stopped once its blocks fit again; swapped
requests are brought back before any waiting request is admitted).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import compress

from pagewarden.kv.block import BlockState
from pagewarden.kv.kv_manager import KVCacheManager
from pagewarden.kv.prefix_hash import encode_extra_keys
from pagewarden.kv.swap_space import BlockSwap
from pagewarden.sched.config import SchedulerConfig
from pagewarden.sched.fast_dataclass import fast_constructor
from pagewarden.sched.output import (
    DecodeBatch,
    KVFault,
    ModelRunnerOutput,
    SamplingInputs,
    ScheduledRequest,
    SchedulerOutput,
    SlotRun,
    TokenLogprobs,
)
from pagewarden.sched.request import Request, RequestStatus, stop_token_set

__all__ = [
    "IntegrityEvent",
    "RecoveryReport",
    "RequestRejectedError",
    "RequestUpdate",
    "Scheduler",
    "SchedulerStats",
    "StepUpdates",
]

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_SWAPPED = RequestStatus.SWAPPED
#: Child seed = parent seed * _SEED_MIX + child index (n > 1).
_SEED_MIX = 1000003


class RequestRejectedError(ValueError):
    """A request that can never be served (too long for the model or the pool)."""


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What one step produced for one request (only requests that sampled a token)."""

    req_id: str
    parent_id: str | None
    index: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class StepUpdates:
    """What ``update`` produced, one entry per sampled token in step order, columnar:
    request ``req_ids[i]`` sampled ``token_ids[i]``.

    ``finished`` maps the id of each request that finished this step to its
    ``RequestUpdate``. Iterating or indexing gives one ``RequestUpdate`` per entry (built
    on first use, then kept) for code that wants objects; do that before the scheduler
    changes again (the next step, an abort), since entries that did not finish are
    described from the live requests.
    """

    __slots__ = ("req_ids", "token_ids", "finished", "logprobs", "_live", "_updates")

    def __init__(
        self,
        req_ids: list[str],
        token_ids: list[int],
        finished: dict[str, RequestUpdate],
        logprobs: dict[str, TokenLogprobs],
        live: dict[str, Request],
    ) -> None:
        self.req_ids = req_ids
        self.token_ids = token_ids
        self.finished = finished
        self.logprobs = logprobs
        self._live = live
        self._updates: list[RequestUpdate] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __iter__(self) -> Iterator[RequestUpdate]:
        return iter(self.updates())

    def __getitem__(self, index: int) -> RequestUpdate:
        return self.updates()[index]

    def updates(self) -> list[RequestUpdate]:
        """The entries as ``RequestUpdate`` objects."""
        if self._updates is None:
            finished = self.finished
            logprobs = self.logprobs
            live = self._live
            built = []
            for rid, token in zip(self.req_ids, self.token_ids):
                u = finished.get(rid)
                if u is None:
                    req = live.get(rid)
                    if req is None:
                        raise RuntimeError(
                            f"request {rid!r} left the scheduler before this step's updates "
                            f"were read; read StepUpdates before aborting or stepping again"
                        )
                    lps = [logprobs[rid]] if logprobs and rid in logprobs else []
                    u = _new_request_update(
                        rid,
                        req.parent_id,
                        req.index,
                        [token],
                        False,
                        None,
                        None,
                        req.num_prompt_tokens,
                        req.num_cached_tokens,
                        lps,
                    )
                built.append(u)
            self._updates = built
        return self._updates

    def __repr__(self) -> str:
        return f"StepUpdates({self.updates()!r})"


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of scheduler and pool counters (token counts for the prefix cache)."""

    num_steps: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    total_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    quarantined_blocks: int
    block_allocations: int
    block_frees: int
    retired_blocks: int = 0
    ownership_violations: int = 0
    num_swapped: int = 0  # requests whose KV is in the host tier now
    host_blocks: int = 0
    free_host_blocks: int = 0
    swapped_out_blocks: int = 0  # device -> host block copies, ever
    swapped_in_blocks: int = 0  # host -> device block copies, ever


@dataclass(frozen=True, slots=True)
class IntegrityEvent:
    """A metadata fault the scheduler caught itself, before the step that would read it.

    ``kind`` is "stale_ref" (a table entry's block was freed under it: use after free),
    "table_mismatch" (a table's block id disagrees with its epoch-tagged reference) or
    "free_list" (a block the table holds was on the free queue: taken off it, nothing
    recomputed; ``position`` is then the request's progress).
    """

    kind: str
    req_id: str
    block_id: int
    position: int  # the request recomputes from here


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What ``Scheduler.recover`` did."""

    quarantined: tuple[int, ...]
    rolled_back: dict[str, int]  # req_id -> position it recomputes from
    recomputed_tokens: int  # computed tokens thrown away
    # Requests that cannot be served any more, by top-level id (a child's parent id).
    failed: tuple[str, ...] = ()

    @property
    def unrecoverable(self) -> bool:
        return bool(self.failed)


class _DecodeCarry:
    """What ``update`` leaves for the next ``schedule`` when every running request sampled
    exactly one token: the next step is then all plain decodes, in running order.

    ``reqs`` is the running list as ``update`` left it, ``positions`` each request's
    ``num_computed_tokens`` then, and ``block_tables`` their ``ids`` lists as of the
    manager's ``table_version``. ``schedule`` uses the carry only if all three still hold
    (an abort, a rollback or a preemption since changes them), so what it builds is
    exactly what ``_schedule_running`` would.
    """

    __slots__ = (
        "reqs",
        "req_ids",
        "token_ids",
        "positions",
        "block_tables",
        "inputs",
        "table_version",
    )

    def __init__(
        self,
        reqs: list[Request],
        req_ids: list[str],
        token_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        inputs: list[SamplingInputs],
        table_version: int,
    ) -> None:
        self.reqs = reqs
        self.table_version = table_version
        self.req_ids = req_ids
        self.token_ids = token_ids
        self.positions = positions
        self.block_tables = block_tables
        self.inputs = inputs


_new_scheduled_request = fast_constructor(ScheduledRequest)
_new_request_update = fast_constructor(RequestUpdate)
_new_scheduler_output = fast_constructor(SchedulerOutput)
_new_decode_batch = fast_constructor(DecodeBatch)
_new_sampling_inputs = fast_constructor(SamplingInputs)


def _target(req: Request) -> int:
    """How many of ``req``'s tokens should be computed: all of them, or ``prompt[:-1]`` for
    an ``n > 1`` parent (each child computes the last prompt token itself)."""
    if req.sampling_params.n > 1 and req.parent_id is None:
        return len(req.prompt_token_ids) - 1
    return len(req.all_token_ids)


class Scheduler:
    """Owns the waiting queue, the running list and (through ``kv``) every block table.

    Invariants (``check_invariants``): a request is live iff it is in exactly one of
    ``waiting``/``running``; running requests hold a block table, waiting ones do not;
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
        self.swapped: deque[Request] = deque()
        self._swap_by_preemption = config.preemption_mode == "swap"
        self._swap_out: list[BlockSwap] = []
        self._swap_in: list[BlockSwap] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Fork parent id -> ids of its live children (so aborting the parent reaches them).
        self._children: dict[str, set[str]] = {}
        self._left_ids: list[str] = []
        self._preempted_ids: list[str] = []
        self._num_steps = 0
        self.num_preemptions = 0
        self._carry: _DecodeCarry | None = None

    # ------------------------------------------------------------- admission
    def add_request(self, request: Request) -> None:
        """Queue ``request``; raises ``RequestRejectedError`` if it can never be served."""
        self.kv.pool.check_owner()
        cfg = self.config
        rid = request.req_id
        if rid in self.requests or rid in self._children:
            raise RequestRejectedError(f"request id {rid!r} is already in use")
        params = request.sampling_params
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise RequestRejectedError(f"request {rid!r} has an empty prompt")
        if params.max_tokens is None:
            max_tokens = cfg.max_model_len - num_prompt
            if max_tokens < 1:
                raise RequestRejectedError(
                    f"request {rid!r}: prompt of {num_prompt} tokens leaves no room to "
                    f"generate within max_model_len={cfg.max_model_len}; shorten the prompt"
                )
        else:
            max_tokens = params.max_tokens
            if num_prompt + max_tokens > cfg.max_model_len:
                raise RequestRejectedError(
                    f"request {rid!r}: prompt ({num_prompt} tokens) + max_tokens "
                    f"({max_tokens}) = {num_prompt + max_tokens} exceeds max_model_len="
                    f"{cfg.max_model_len}; shorten the prompt or lower max_tokens"
                )
        bs = cfg.block_size
        # The last sampled token is never computed, so K/V covers prompt + max_tokens - 1.
        blocks_needed = (num_prompt + max_tokens - 1 + bs - 1) // bs
        retired = len(self.kv.pool.retired)
        usable = cfg.num_blocks - 1 - retired
        if blocks_needed > usable:
            raise RequestRejectedError(
                f"request {rid!r} needs up to {blocks_needed} KV blocks but the pool has "
                f"only {usable} usable (num_blocks={cfg.num_blocks}, block 0 reserved, "
                f"{retired} retired after failed checks); lower max_tokens or raise num_blocks"
            )
        if params.n > cfg.max_num_seqs:
            raise RequestRejectedError(
                f"request {rid!r}: n={params.n} exceeds max_num_seqs={cfg.max_num_seqs}"
            )
        # Invariant used by update(): num_prompt + max_tokens <= max_model_len, so a request
        # below max_tokens outputs is also below max_model_len tokens.
        request.max_tokens = max_tokens
        request.stop_ids = stop_token_set(params, request.eos_token_ids)
        request.extra_keys = encode_extra_keys(cfg.model_id, request.cache_salt)
        request.seed = params.seed
        request.sampling_inputs = _new_sampling_inputs(
            params, request.prompt_token_ids, request.output_token_ids, params.seed
        )
        request.status = _WAITING
        if request.is_fork_parent and num_prompt == 1:
            # prompt[:-1] is empty: nothing to share, the children start on their own.
            children = self._make_children(request)
            self._children[rid] = {c.req_id for c in children}
            for child in children:
                child.status = _WAITING
                self.requests[child.req_id] = child
                self.waiting.append(child)
            return
        self.requests[rid] = request
        self.waiting.append(request)

    def _make_children(self, parent: Request) -> list[Request]:
        params = parent.sampling_params
        children = []
        for i in range(params.n):
            child = Request(
                f"{parent.req_id}#{i}",
                parent.prompt_token_ids,
                params,
                parent.eos_token_ids,
                parent.cache_salt,
                parent.arrival_time,
            )
            child.parent_id = parent.req_id
            child.index = i
            child.max_tokens = parent.max_tokens
            child.stop_ids = parent.stop_ids
            child.extra_keys = parent.extra_keys
            child.seed = None if params.seed is None else params.seed * _SEED_MIX + i
            child.sampling_inputs = _new_sampling_inputs(
                params, child.prompt_token_ids, child.output_token_ids, child.seed
            )
            child.num_cached_tokens = parent.num_cached_tokens
            child.num_computed_tokens = parent.num_computed_tokens
            children.append(child)
        return children

    # ---------------------------------------------------------- abort/finish
    def abort_requests(self, req_ids: Iterable[str]) -> None:
        """Abort requests (a fork parent's id aborts all its children); unknown ids ignored."""
        self._finish_many(req_ids, RequestStatus.FINISHED_ABORTED, "abort", None)

    def finish_requests(self, req_ids: Iterable[str], stop_reason: str | None) -> None:
        """The engine found a stop string: finish these requests with reason "stop"."""
        self._finish_many(req_ids, RequestStatus.FINISHED_STOPPED, "stop", stop_reason)

    def _finish_many(
        self,
        req_ids: Iterable[str],
        status: RequestStatus,
        reason: str,
        stop_reason: int | str | None,
    ) -> None:
        self.kv.pool.check_owner()
        for rid in list(req_ids):
            targets = [rid] + sorted(self._children.get(rid, ()))
            for tid in targets:
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
        del self.requests[req.req_id]
        self._left_ids.append(req.req_id)
        pid = req.parent_id
        if pid is not None:
            live = self._children.get(pid)
            if live is not None:
                live.discard(req.req_id)
                if not live:
                    del self._children[pid]

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocate their slots."""
        self.kv.pool.check_owner()
        self._num_steps += 1
        scheduled: list[ScheduledRequest] = []
        copies: list[tuple[int, int]] = []
        decodes = self._carried_decodes()
        if decodes is None:
            decodes = _new_decode_batch(self.config.block_size, [], [], [], [], [])
            budget, preempted = self._schedule_running(scheduled, copies, decodes)
        else:
            budget, preempted = self.config.max_num_batched_tokens - len(decodes.req_ids), False
        if not preempted:  # a pool that just ran dry admits nobody new
            # Seats left for requests that are not running yet.
            seats = self.config.max_num_seqs - len(decodes.req_ids)
            if self.swapped:
                budget = self._schedule_swapped(budget, scheduled, seats)
            if not self.swapped:  # swapped requests come back before new ones start
                self._schedule_waiting(budget, scheduled, copies, seats)
        left = self._left_ids
        self._left_ids = []
        pre = self._preempted_ids
        self._preempted_ids = []
        if self._swap_out or self._swap_in:
            swap_out, swap_in = self._swap_out, self._swap_in
            self._swap_out, self._swap_in = [], []
            return _new_scheduler_output(
                self._num_steps, scheduled, copies, left, pre, swap_out, swap_in, decodes
            )
        return _new_scheduler_output(self._num_steps, scheduled, copies, left, pre, decodes=decodes)

    def _carried_decodes(self) -> DecodeBatch | None:
        """The step's decode batch from the last ``update``'s carry, or None when it does
        not apply (then ``_schedule_running`` goes request by request).

        It applies when the running list, every running request's progress and every
        block table are as ``update`` left them, every request fits the budget and the
        seats, and no fork family is alive (so no open block is shared and nothing is
        copied on write).
        Decodes that open a block get it here, in running order, as
        ``_schedule_running`` would; when the pool has too few free blocks for all of
        them, the general path preempts instead.
        """
        carry = self._carry
        if carry is None:
            return None
        self._carry = None
        running = self.running
        cfg = self.config
        n = len(running)
        if (
            n > cfg.max_num_batched_tokens
            or n > cfg.max_num_seqs
            or self._children
            or self.kv.table_version != carry.table_version
            or running != carry.reqs
        ):  # compares by identity, in C
            return None
        positions = [r.num_computed_tokens for r in running]
        if positions != carry.positions:
            return None  # rolled back since
        bs = cfg.block_size
        req_ids = carry.req_ids
        block_tables = carry.block_tables  # current: no table has changed since
        opening = [i for i, p in enumerate(positions) if not p % bs]
        if opening:
            # Each of these tokens opens a block its table does not have yet (anything
            # else is the general path's to sort out), and all of them must get one.
            kv = self.kv
            if any(
                len(block_tables[i]) != positions[i] // bs for i in opening
            ) or not kv.append_blocks([req_ids[i] for i in opening]):
                return None
            tables = kv.tables
            for i in opening:
                block_tables[i] = tables[req_ids[i]].ids
        return _new_decode_batch(
            bs, req_ids, carry.token_ids, positions, block_tables, carry.inputs
        )

    def _schedule_running(
        self,
        scheduled: list[ScheduledRequest],
        copies: list[tuple[int, int]],
        decodes: DecodeBatch,
    ) -> tuple[int, bool]:
        """Schedule running requests in order, preempting from the back when the pool runs
        dry; returns the token budget left and whether anything was preempted. Plain
        decodes go to ``decodes``, everything else to ``scheduled``."""
        cfg = self.config
        kv = self.kv
        tables = kv.tables
        blocks = kv.pool.blocks
        allocate_slots = kv.allocate_slots
        append_block = kv.append_block
        bs = cfg.block_size
        budget = cfg.max_num_batched_tokens
        max_seqs = cfg.max_num_seqs
        running = self.running
        # Columns appended to directly: ``lst.append(x)`` is a specialised, call-free
        # instruction, a pre-bound ``append`` is a full call.
        decode_ids = decodes.req_ids
        decode_tokens = decodes.token_ids
        decode_positions = decodes.positions
        decode_tables = decodes.block_tables
        decode_inputs = decodes.inputs
        preempted = False
        # Each running request is scheduled at most once and preemption only shrinks
        # ``running``, so the seat limit can only bind when running is over it (forks).
        check_seats = len(running) > max_seqs
        # Preemption pops from the back of ``running``; the iterator stops short of it.
        for req in running:
            if budget <= 0 or check_seats and len(scheduled) + len(decode_ids) >= max_seqs:
                break
            start = req.num_computed_tokens
            tokens = req.all_token_ids
            if len(tokens) - start == 1:
                # Decode fast path: one token at ``start``, into the last block, or into a
                # new one when ``start`` opens it (one-block allocation; when the pool is
                # dry, the general path below preempts). A last block a fork still shares
                # is copied on write by the general path. A fork parent never gets here:
                # it always has at least two prompt tokens to go.
                rid = req.req_id
                offset = start % bs
                ids = tables[rid].ids
                if offset:
                    # Only fork children share a partly filled block (prefix hits share
                    # full blocks only), so only they need the reference count looked up.
                    fast = req.parent_id is None or blocks[ids[start // bs]].ref_cnt == 1
                elif len(ids) == start // bs:  # the token opens a new block
                    fast = append_block(rid) is not None
                    if fast:
                        ids = tables[rid].ids
                else:  # the block is there already (no copy on write at offset 0)
                    fast = allocate_slots(rid, start, 1) is not None
                    if fast:
                        ids = tables[rid].ids
                if fast:
                    decode_ids.append(rid)
                    decode_tokens.append(tokens[start])
                    decode_positions.append(start)
                    decode_tables.append(ids)
                    decode_inputs.append(req.sampling_inputs)
                    budget -= 1
                    continue
            num_new = _target(req) - start
            if num_new <= 0:
                continue
            if num_new > budget:
                num_new = budget
            while True:
                cow = kv.allocate_slots(req.req_id, start, num_new)
                if cow is not None:
                    break
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if cow is None:
                break
            if cow:
                copies.extend(cow)
            scheduled.append(self._scheduled_request(req, num_new))
            budget -= num_new
        return budget, preempted

    def _schedule_swapped(self, budget: int, scheduled: list[ScheduledRequest], seats: int) -> int:
        """Swap requests back in, in order, while budget, seats (``seats`` minus what
        ``scheduled`` holds) and free blocks last, and schedule their next tokens; returns
        the budget left."""
        kv = self.kv
        bs = self.config.block_size
        max_seqs = self.config.max_num_seqs
        running = self.running
        swapped = self.swapped
        while swapped and budget > 0 and len(running) < max_seqs and len(scheduled) < seats:
            req = swapped[0]
            start = req.num_computed_tokens
            num_new = min(_target(req) - start, budget)
            # Its blocks come back and this step's tokens need room too (fresh, private
            # blocks: no copy on write).
            if (start + max(num_new, 0) + bs - 1) // bs > kv.num_free_blocks:
                break
            swaps = kv.swap_in(req.req_id)
            assert swaps is not None, "free blocks were counted above"
            self._swap_in.extend(swaps)
            swapped.popleft()
            req.status = _RUNNING
            running.append(req)
            if num_new <= 0:
                continue
            cow = kv.allocate_slots(req.req_id, start, num_new)
            assert cow == [], f"{req.req_id}: swapped-in blocks are private, got {cow}"
            scheduled.append(self._scheduled_request(req, num_new))
            budget -= num_new
        return budget

    def _schedule_waiting(
        self,
        budget: int,
        scheduled: list[ScheduledRequest],
        copies: list[tuple[int, int]],
        seats: int,
    ) -> None:
        """Admit waiting requests in order while budget, seats (``seats`` minus what
        ``scheduled`` holds) and free blocks last."""
        kv = self.kv
        max_seqs = self.config.max_num_seqs
        running = self.running
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < max_seqs and len(scheduled) < seats:
            req = waiting[0]
            target = _target(req)
            cached = kv.lookup_prefix(req.req_id, req.all_token_ids, req.extra_keys, target - 1)
            num_new = target - cached
            if num_new > budget:
                num_new = budget
            cow = kv.allocate_slots(req.req_id, cached, num_new)
            if cow is None:
                kv.free(req.req_id)  # unpin the prefix we looked up
                break
            waiting.popleft()
            if req.num_preemptions == 0:
                req.num_cached_tokens = min(cached, len(req.prompt_token_ids))
            req.num_computed_tokens = cached
            req.status = _RUNNING
            running.append(req)
            if cow:
                copies.extend(cow)
            scheduled.append(self._scheduled_request(req, num_new))
            budget -= num_new

    def _scheduled_request(self, req: Request, num_new: int) -> ScheduledRequest:
        """``req``'s share of this step: ``num_new`` tokens from ``num_computed_tokens`` on."""
        start = req.num_computed_tokens
        end = start + num_new
        ids = self.kv.tables[req.req_id].ids  # handed out as is: never mutated in place
        tokens = req.all_token_ids
        bs = self.config.block_size
        if num_new == 1:  # a decode that copied its block on write, or a one-token chunk
            slots: list[int] | SlotRun = [ids[start // bs] * bs + start % bs]
        else:  # a chunk: its slots are listed when the worker reads them
            slots = SlotRun(ids, bs, start, end)
        return _new_scheduled_request(
            req.req_id,
            tokens[start:end],
            range(start, end),
            ids,
            slots,
            end == len(tokens),
            req.sampling_params,
            req.prompt_token_ids,
            req.output_token_ids,
            req.seed,
        )

    def _preempt(self, req: Request) -> None:
        """Swap ``req`` out to the host tier (swap mode, room there, KV to keep), else
        recompute: free blocks, forget progress, go to the front of waiting."""
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_ids.append(req.req_id)
        self._left_ids.append(req.req_id)
        if self._swap_by_preemption and req.num_computed_tokens:
            swaps = self.kv.swap_out(req.req_id, req.num_computed_tokens)
            if swaps is not None:
                self._swap_out.extend(swaps)
                req.status = _SWAPPED
                self.swapped.appendleft(req)
                return
        self.kv.free(req.req_id)
        req.num_computed_tokens = 0
        req.status = _WAITING
        self.waiting.appendleft(req)

    # ---------------------------------------------------------------- update
    def update(self, out: SchedulerOutput, res: ModelRunnerOutput) -> StepUpdates:
        """Advance requests by what the step computed; append sampled tokens; finish/fork.

        Returns one entry per sampled token, in step order (the decodes, then
        ``out.requests``).
        """
        self.kv.pool.check_owner()
        requests = self.requests
        sampled = res.sampled_token_ids
        logprobs = res.logprobs
        seal = self.kv.seal_full_blocks
        bs = self.config.block_size
        finished: dict[str, RequestUpdate] = {}
        forked: dict[str, list[Request]] = {}
        decodes = out.decodes
        sampled_ids = decodes.req_ids
        new_tokens = res.decode_token_ids
        if sampled_ids and len(new_tokens) != len(sampled_ids):
            new_tokens = [sampled[rid] for rid in sampled_ids]
        skipped: list[str] = []
        # The general loop below, specialised to one sampled token per request and inlined
        # (this loop runs once per decode token: a helper call would cost a tenth of it).
        for rid, start, token in zip(sampled_ids, decodes.positions, new_tokens):
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING or start != req.num_computed_tokens:
                skipped.append(rid)  # finished, aborted, or preempted and re-admitted since
                continue
            computed = req.num_computed_tokens = start + 1
            tokens = req.all_token_ids
            if not computed % bs:  # this token filled its block
                seal(rid, tokens, computed)
            output = req.output_token_ids
            output.append(token)
            tokens.append(token)
            n_out = len(output)
            # Below max_tokens means below max_model_len too (checked at admission).
            if n_out >= req.max_tokens or (
                token in req.stop_ids and n_out >= req.sampling_params.min_tokens
            ):
                finished[rid] = self._finish_sampled(req, token, logprobs)
        if skipped:  # a decode batch lists each request once
            kept = [(r, t) for r, t in zip(sampled_ids, new_tokens) if r not in skipped]
            sampled_ids = [r for r, _ in kept]
            new_tokens = [t for _, t in kept]
        more_ids: list[str] = []
        more_tokens: list[int] = []
        more_reqs: list[Request] = []
        for sr in out.requests:
            rid = sr.req_id
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue  # finished or aborted since this step was scheduled
            positions = sr.positions
            start = positions.start
            if start != req.num_computed_tokens:
                continue  # preempted and re-admitted since: this chunk is stale
            computed = req.num_computed_tokens = positions.stop
            tokens = req.all_token_ids
            if computed // bs != start // bs:  # this chunk filled at least one block
                seal(rid, tokens, computed)
            if not sr.sample:
                if _target(req) == computed and req.sampling_params.n > 1 and req.parent_id is None:
                    forked[rid] = self._fork(req)
                continue
            token = sampled[rid]
            output = req.output_token_ids
            output.append(token)
            tokens.append(token)
            more_ids.append(rid)
            more_tokens.append(token)
            more_reqs.append(req)
            n_out = len(output)
            if n_out >= req.max_tokens or (
                token in req.stop_ids and n_out >= req.sampling_params.min_tokens
            ):
                finished[rid] = self._finish_sampled(req, token, logprobs)
        if finished or forked:
            self._drop_finished_and_forked(forked)
        if more_ids:
            sampled_ids = sampled_ids + more_ids
            new_tokens = new_tokens + more_tokens
        self._carry = None
        if (
            not skipped
            and not forked
            and not self._children
            and len(self.running) == len(sampled_ids) - len(finished)
        ):
            # Every running request sampled one token: the next step is all decodes.
            self._carry = self._decode_carry(decodes, more_reqs, sampled_ids, new_tokens, finished)
        return StepUpdates(sampled_ids, new_tokens, finished, logprobs, requests)

    def _decode_carry(
        self,
        decodes: DecodeBatch,
        more_reqs: list[Request],
        req_ids: list[str],
        token_ids: list[int],
        finished: dict[str, RequestUpdate],
    ) -> _DecodeCarry | None:
        """The carry for the next step, once every running request has sampled one token:
        ``req_ids``/``token_ids`` in step order, the step's decodes (all of them) and then
        ``more_reqs``, the requests that sampled after a prefill chunk."""
        positions = [p + 1 for p in decodes.positions]
        tables = list(decodes.block_tables)
        inputs = list(decodes.inputs)
        if more_reqs:
            kv_tables = self.kv.tables
            for req in more_reqs:
                positions.append(req.num_computed_tokens)
                entry = kv_tables.get(req.req_id)  # None: it finished (dropped below)
                tables.append(entry.ids if entry is not None else [])
                inputs.append(req.sampling_inputs)
        if len(positions) != len(req_ids):
            return None
        req_ids = list(req_ids)
        token_ids = list(token_ids)
        if finished:  # find them in C, then delete back to front (each del shifts the tail)
            gone = list(compress(range(len(req_ids)), map(finished.__contains__, req_ids)))
            for i in reversed(gone):
                del req_ids[i], token_ids[i], positions[i], tables[i], inputs[i]
        requests = self.requests
        return _DecodeCarry(
            [requests[rid] for rid in req_ids],
            req_ids,
            token_ids,
            positions,
            tables,
            inputs,
            self.kv.table_version,
        )

    def _finish_sampled(
        self, req: Request, token: int, logprobs: dict[str, TokenLogprobs]
    ) -> RequestUpdate:
        """Finish ``req``, whose just-sampled ``token`` stopped it or hit a length limit."""
        params = req.sampling_params
        n_out = len(req.output_token_ids)
        status = RequestStatus.FINISHED_LENGTH
        reason = "length"
        stop_reason: int | str | None = None
        if n_out >= params.min_tokens:
            if token in params.stop_token_ids:  # type: ignore[operator]
                status, reason, stop_reason = RequestStatus.FINISHED_STOPPED, "stop", token
            elif not params.ignore_eos and token in req.eos_token_ids:
                status, reason = RequestStatus.FINISHED_STOPPED, "stop"
        self._finish(req, status, reason, stop_reason)
        rid = req.req_id
        lps = [logprobs[rid]] if logprobs and rid in logprobs else []
        return _new_request_update(
            rid,
            req.parent_id,
            req.index,
            [token],
            True,
            reason,
            stop_reason,
            len(req.prompt_token_ids),
            req.num_cached_tokens,
            lps,
        )

    def _drop_finished_and_forked(self, forked: dict[str, list[Request]]) -> None:
        """Rebuild ``running`` without finished requests, forked parents by their children."""
        if not forked:
            self.running = [r for r in self.running if r.status is _RUNNING]
            return
        new_running: list[Request] = []
        for r in self.running:
            if r.status is _RUNNING:
                kids = forked.get(r.req_id)
                if kids is None:
                    new_running.append(r)
                else:
                    new_running.extend(kids)
        self.running = new_running

    def _fork(self, parent: Request) -> list[Request]:
        """Replace a parent that has prefilled ``prompt[:-1]`` by its ``n`` children."""
        children = self._make_children(parent)
        self.kv.fork(parent.req_id, [c.req_id for c in children])
        del self.requests[parent.req_id]
        self._children[parent.req_id] = {c.req_id for c in children}
        for child in children:
            child.status = _RUNNING
            self.requests[child.req_id] = child
        self._left_ids.append(parent.req_id)
        return children

    # --------------------------------------------------------------- queries
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        counts = pool.state_counts()
        return SchedulerStats(
            num_steps=self._num_steps,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            total_blocks=pool.num_blocks,
            free_blocks=counts[BlockState.FREE],
            cached_blocks=counts[BlockState.CACHED_FREE],
            used_blocks=counts[BlockState.USED],
            quarantined_blocks=counts[BlockState.QUARANTINED],
            block_allocations=pool.num_allocations,
            block_frees=pool.num_frees,
            retired_blocks=len(pool.retired),
            ownership_violations=pool.ownership_violations,
            num_swapped=len(self.swapped),
            host_blocks=self.kv.swap.num_blocks,
            free_host_blocks=self.kv.swap.num_free_blocks,
            swapped_out_blocks=self.kv.swap.num_swapped_out,
            swapped_in_blocks=self.kv.swap.num_swapped_in,
        )

    def check_invariants(self) -> list[str]:
        """Scheduler + KV invariant violations; empty when sound."""
        errors = self.kv.check_invariants()
        queues = {
            "running": [r.req_id for r in self.running],
            "waiting": [r.req_id for r in self.waiting],
            "swapped": [r.req_id for r in self.swapped],
        }
        for name, ids in queues.items():
            if len(set(ids)) != len(ids):
                errors.append(f"a request is listed twice in {name}")
        seen: dict[str, str] = {}
        for name, ids in queues.items():
            for rid in ids:
                if rid in seen and seen[rid] != name:
                    errors.append(f"{rid} is both {seen[rid]} and {name}")
                seen[rid] = name
        live = set(seen)
        if live != set(self.requests):
            errors.append(
                f"live requests {sorted(set(self.requests))} != "
                f"running+waiting+swapped {sorted(live)}"
            )
        tables = set(self.kv.tables)
        if tables != set(queues["running"]):
            errors.append(
                f"block tables {sorted(tables)} != running requests {sorted(queues['running'])}"
            )
        if set(self.kv.swap.tables) != set(queues["swapped"]):
            errors.append(
                f"swapped tables {sorted(self.kv.swap.tables)} != swapped "
                f"requests {sorted(queues['swapped'])}"
            )
        for queue, status in (
            (self.running, _RUNNING),
            (self.waiting, _WAITING),
            (self.swapped, _SWAPPED),
        ):
            for r in queue:
                if r.status is not status:
                    errors.append(f"{r.req_id} in {status.value} with status {r.status.name}")
        bs = self.config.block_size
        blocks = self.kv.pool.blocks
        for r in self.running:
            # The decode fast path relies on this: only fork children share a partly
            # filled block (see _schedule_running).
            entry = self.kv.tables.get(r.req_id)
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
        for r in self.requests.values():
            if not 0 <= r.num_computed_tokens <= r.num_tokens:
                errors.append(
                    f"{r.req_id}: num_computed_tokens {r.num_computed_tokens} "
                    f"outside [0, {r.num_tokens}]"
                )
            if r.all_token_ids != r.prompt_token_ids + r.output_token_ids:
                errors.append(f"{r.req_id}: all_token_ids out of step with prompt + output")
        return errors

    # ------------------------------------------------------------- integrity
    def claim_ownership(self) -> None:
        """Make the calling thread the only one allowed to mutate scheduler and KV state."""
        self.kv.pool.claim_ownership()

    def verify_block_tables(self) -> list[IntegrityEvent]:
        """Roll back every running request whose table names a freed or altered block.

        Run before ``schedule()``: a table entry whose epoch-tagged reference no longer
        matches its block would let the request read (and write into) a block that now
        belongs to someone else. The request recomputes from the start of that block.
        """
        self.kv.pool.check_owner()
        events: list[IntegrityEvent] = []
        kv = self.kv
        bs = self.config.block_size
        blocks = kv.pool.blocks
        for req in self.running:
            while (index := kv.first_unsound_block(req.req_id)) is not None:
                entry = kv.tables[req.req_id]
                ref = entry.refs[index]
                if entry.ids[index] != ref.block_id:
                    kind = "table_mismatch"
                elif blocks[ref.block_id].epoch != ref.epoch:
                    kind = "stale_ref"
                else:
                    # Held, yet on the free queue (or counted free): nothing was handed
                    # out yet (allocation comes after this check), so the K/V is intact.
                    # Take it off the queue; the request keeps its progress.
                    kv.reconcile()
                    position = req.num_computed_tokens
                    events.append(IntegrityEvent("free_list", req.req_id, ref.block_id, position))
                    continue
                events.append(IntegrityEvent(kind, req.req_id, ref.block_id, index * bs))
                self._roll_back(req, index * bs)
                break
        return events

    def recover(self, faults: list[KVFault]) -> RecoveryReport:
        """Quarantine the failed blocks and roll back every request that holds one.

        Each request recomputes from the start of the first failed block in its table
        (or the rollback position a fault names, if earlier); KV is a pure function of
        the tokens, so the output is what it would have been without the fault. A request
        that no longer fits in the healthy (non-retired) blocks is failed.
        """
        self.kv.pool.check_owner()
        pool = self.kv.pool
        bs = self.config.block_size
        bad = {b for f in faults for b in f.block_ids if b != 0}
        targets: dict[str, int] = {}
        for f in faults:
            for rid, pos in f.rollback.items():
                targets[rid] = min(targets.get(rid, pos), pos)
        for rid, index in self.kv.holders(bad).items():
            targets[rid] = min(targets.get(rid, index * bs), index * bs)
        for block_id in sorted(bad):
            pool.quarantine(block_id)
        rolled_back: dict[str, int] = {}
        recomputed = 0
        for rid, pos in targets.items():
            req = self.requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue
            before = req.num_computed_tokens
            rolled_back[rid] = self._roll_back(req, pos)
            recomputed += before - rolled_back[rid]
        failed = self._fail_unservable(rolled_back)
        # Rollbacks free by the entries the tables hold; an entry that named another
        # request's block freed that block, not its own. Counting the references the
        # tables really hold frees whatever is left over, so no fault leaks a block.
        self.kv.reconcile()
        return RecoveryReport(tuple(sorted(bad)), rolled_back, recomputed, failed)

    def repair(self) -> RecoveryReport:
        """Recover from metadata an invariant audit found inconsistent.

        Blocks more tables hold than their ref_cnt counts are quarantined and every
        holder rolls back to before them (any of them may have overwritten the others'
        K/V); then ref counts and the free queue are rebuilt from the references the
        tables really hold (leaked references freed, held blocks off the free queue).
        """
        self.kv.pool.check_owner()
        over = self.kv.overshared_blocks()
        detail = "blocks held by more tables than their reference count"
        return self.recover([KVFault("refcount", tuple(over), {}, "audit", detail)])

    def _roll_back(self, req: Request, position: int) -> int:
        """Forget computed tokens from the block holding ``position`` on; returns the
        block-aligned position the request recomputes from."""
        bs = self.config.block_size
        keep = min(req.num_computed_tokens, position) // bs
        req.num_computed_tokens = keep * bs
        self.kv.truncate(req.req_id, keep)
        return keep * bs

    def _fail_unservable(self, req_ids: Iterable[str]) -> tuple[str, ...]:
        """Abort requests that can no longer fit in the pool's healthy blocks."""
        bs = self.config.block_size
        healthy = self.config.num_blocks - 1 - len(self.kv.pool.retired)
        failed: list[str] = []
        top_ids: set[str] = set()
        for rid in req_ids:
            req = self.requests[rid]
            need = (len(req.prompt_token_ids) + req.max_tokens - 1 + bs - 1) // bs
            if need > healthy:
                failed.append(rid)
                top_ids.add(req.parent_id if req.parent_id is not None else rid)
        if failed:
            self._finish_many(failed, RequestStatus.FINISHED_ABORTED, "error", None)
        return tuple(sorted(top_ids))

    def quarantined_block_ids(self) -> list[int]:
        """Quarantined blocks nobody holds any more and that are not retired: ready to be
        scrubbed, re-verified and released."""
        pool = self.kv.pool
        blocks = pool.blocks
        return sorted(
            b for b in pool.quarantined if blocks[b].ref_cnt == 0 and b not in pool.retired
        )

    def release_quarantined(self, block_ids: Iterable[int]) -> None:
        """Return scrubbed and re-verified blocks to service."""
        self.kv.pool.check_owner()
        for block_id in block_ids:
            self.kv.pool.release_quarantine(block_id)
