"""What the scheduler's helpers may read and change of it, as a protocol.

``preemption.py``, ``recovery.py`` and ``invariants.py`` work on the scheduler's queues
and its KV manager; ``Scheduler`` (``scheduler.py``) calls them. They are written against
this description rather than against ``Scheduler`` itself, so that imports run one way:
``scheduler.py`` imports the helpers, the helpers import this module, and nothing here
imports ``scheduler.py``. ``Scheduler`` is the one implementation; mypy checks that it
fits wherever it is handed to a helper.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from pagewarden.kv.block import BlockState
from pagewarden.kv.kv_manager import KVCacheManager
from pagewarden.kv.swap_space import BlockSwap
from pagewarden.sched.config import SchedulerConfig
from pagewarden.sched.request import Request, RequestStatus
from pagewarden.sched.stats import SchedulerStats


class SchedulerState(Protocol):
    """The scheduler's queues, counters and KV manager (see ``Scheduler`` for what each
    holds and the invariants between them)."""

    config: SchedulerConfig
    kv: KVCacheManager
    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]
    swapped: deque[Request]
    # Handed to the runner with the next step.
    departed_ids: list[str]
    preempted_ids: list[str]
    swap_out: list[BlockSwap]
    swap_in: list[BlockSwap]
    num_preemptions: int
    max_num_seqs: int  # the effective seat limit of a step
    max_num_batched_tokens: int  # the effective token budget of a step
    num_steps: int
    last_group_step: int | None  # the last step given the whole budget (prefill_cap.py)
    group_wait_since: int | None  # the step since which group-sized work waits (same)
    group_wait_work: int  # prefill tokens pending at the last step's cap (same)
    group_grew_at: int  # the last step in which they grew (same)
    preemption_mode: str

    def usable_blocks(self) -> int:
        """Blocks one request may hold: all but block 0 and the retired ones."""
        ...

    def _finish_unjournaled(
        self,
        req_ids: list[str],
        status: RequestStatus,
        reason: str,
        stop_reason: int | str | None = None,
    ) -> None:
        """Finish requests (and their fork children) as part of a journaled call.

        Private to the scheduler and its helpers: no owner check and no journal entry of
        its own (the public call that makes it has both)."""
        ...


def scheduler_stats(sched: SchedulerState) -> SchedulerStats:
    """The scheduler's counters and the pool's block states, as one snapshot."""
    pool = sched.kv.pool
    counts = pool.state_counts()
    swap = sched.kv.swap
    return SchedulerStats(
        num_steps=sched.num_steps,
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_swapped=len(sched.swapped),
        num_preemptions=sched.num_preemptions,
        effective_max_num_seqs=sched.max_num_seqs,
        effective_max_num_batched_tokens=sched.max_num_batched_tokens,
        prefix_cache_queries=sched.kv.prefix_cache_queries,
        prefix_cache_hits=sched.kv.prefix_cache_hits,
        total_blocks=pool.num_blocks,
        free_blocks=counts[BlockState.FREE],
        cached_blocks=counts[BlockState.CACHED_FREE],
        used_blocks=counts[BlockState.USED],
        quarantined_blocks=counts[BlockState.QUARANTINED],
        block_allocations=pool.num_allocations,
        block_frees=pool.num_frees,
        retired_blocks=len(pool.retired),
        ownership_violations=pool.ownership_violations,
        host_blocks=swap.num_blocks,
        free_host_blocks=swap.num_free_blocks,
        swapped_out_blocks=swap.num_swapped_out,
        swapped_in_blocks=swap.num_swapped_in,
    )
