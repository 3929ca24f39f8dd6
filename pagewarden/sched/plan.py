"""The step being built: what ``Scheduler.schedule`` has granted so far."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagewarden.sched.output import ScheduledRequest, slot_mapping_for
from pagewarden.sched.prefill_cap import prefill_cap
from pagewarden.sched.request import Request

# The step's cap on prefill tokens is decided in prefill_cap.py; the scheduler takes it here.
__all__ = ["StepPlan", "needs_prompt_logprobs", "prefill_cap", "scheduled_request"]


@dataclass
class StepPlan:
    """The requests scheduled so far this step, the copies they need and the token budget
    left. ``preempted`` is set once the pool ran dry: such a step admits nobody new.

    ``prefill_left`` is what is left of the step's cap on prefill tokens (a request more
    than one token behind), at most ``budget`` (``prefill_cap.py``); a decode's one token
    counts only against ``budget``."""

    budget: int
    prefill_left: int
    requests: list[ScheduledRequest] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: bool = False

    def grant(self, gap: int) -> int:
        """How many of a request's ``gap`` uncomputed tokens this step can take."""
        return min(gap, self.budget) if gap <= 1 else min(gap, self.budget, self.prefill_left)

    def add(self, req: Request, num_new: int, block_table: list[int], block_size: int) -> None:
        """Schedule ``num_new`` of ``req``'s tokens from ``num_computed_tokens`` on."""
        if req.num_computable_tokens - req.num_computed_tokens > 1:
            self.prefill_left -= num_new
        self.requests.append(scheduled_request(req, num_new, block_table, block_size))
        self.budget -= num_new


def scheduled_request(
    req: Request, num_new: int, block_table: list[int], block_size: int
) -> ScheduledRequest:
    """``req``'s share of a step: ``num_new`` tokens from ``num_computed_tokens`` on.

    ``block_table`` is handed over as is: the KV manager replaces a table's id list on
    every change and never mutates it, so the runner may hold it.
    """
    start = req.num_computed_tokens
    end = start + num_new
    tokens = req.all_token_ids
    return ScheduledRequest(
        req_id=req.req_id,
        token_ids=tokens[start:end],
        positions=range(start, end),
        block_table=block_table,
        slot_mapping=slot_mapping_for(block_table, block_size, start, end),
        sample=end == len(tokens),
        sampling_params=req.sampling_params,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=req.output_token_ids,
        seed=req.seed,
        score_prompt=needs_prompt_logprobs(req) and start < req.num_prompt_tokens - 1,
        rope_long=req.rope_long,
    )


def needs_prompt_logprobs(req: Request) -> bool:
    """True while ``req`` asked for prompt logprobs and has not reported them: a top-level
    request (a fork parent scores the prompt for its children) before its first token."""
    return (
        req.sampling_params.prompt_logprobs is not None
        and req.parent_id is None
        and not req.output_token_ids
    )
