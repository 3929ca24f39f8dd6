"""The dataclasses that cross from the scheduler to the model runner and back.

These are the whole contract between ``sched/`` (pure Python) and ``worker/`` (torch):
a runner needs nothing but a ``SchedulerOutput`` to run a step, and the scheduler needs
nothing but a ``ModelRunnerOutput`` to advance its requests.

Slot arithmetic, for ``block_size = 4``::

    block_table = [7, 3]            position p lives in block_table[p // 4], offset p % 4
    positions   = range(5, 7)       tokens 5 and 6 are computed this step
    slots       = [3*4 + 1, 3*4 + 2] = [13, 14]

    physical slot s = block_id * block_size + offset   (block 0 is reserved padding)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from pagewarden.kv.block_pool import EvictedBlock
from pagewarden.kv.swap_space import BlockSwap
from pagewarden.sampling_params import SamplingParams


def slot_mapping_for(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Physical slots of positions ``[start, end)``::

    block_size = 4, block_ids = [7, 3], positions 2..6
    block 7 (slots 28..31): 30, 31        offsets 2, 3
    block 3 (slots 12..15): 12, 13, 14    offsets 0, 1, 2
    """
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step; read-only once built (not frozen: one is built per
    request per step, and a frozen dataclass pays an ``object.__setattr__`` per field).

    ``token_ids[i]`` sits at ``positions[i]`` and its K/V goes to ``slot_mapping[i]``.
    Attention for these tokens reads positions ``[0, positions.stop)`` through
    ``block_table``. ``prompt_token_ids`` and ``output_token_ids`` are read-only views for
    penalties; the runner must not mutate them.
    """

    req_id: str
    token_ids: list[int]
    positions: range
    block_table: list[int]
    slot_mapping: list[int]
    # True when this chunk ends at the last known token, so a token is sampled from it.
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Seed for this request's sampling noise (the child index of n > 1 is already mixed
    # in); None means "use the engine's generator".
    seed: int | None = None
    # True when the request asked for prompt logprobs and this chunk computes prompt
    # positions whose next token's logprob it has not reported yet: the runner scores
    # ``prompt_token_ids[p + 1]`` for each of its positions ``p < len(prompt) - 1``.
    score_prompt: bool = False
    # True when these tokens are rotated with the model's long RoPE factors (Phi-3
    # longrope on a sequence past its original context; see
    # SchedulerConfig.rope_switch_tokens).
    rope_long: bool = False

    @property
    def num_context_tokens(self) -> int:
        """Tokens already in the KV cache before this step."""
        return self.positions.start

    @property
    def sample_index(self) -> int:
        """Index of the output token sampled this step (for seeded determinism)."""
        return len(self.output_token_ids)


@dataclass(frozen=True, slots=True)
class TierLoad:
    """A verified KV tier entry for logical block ``index`` of ``req_id``, to copy into
    pool block ``block_id`` before the forward pass. The runner recomputes the checksum
    over the bytes in the pool and sets the block's tags from the request's chain; a
    mismatch is a "checksum" fault found by "tier_load" (the request recomputes)."""

    block_id: int
    payload: bytes
    checksum: int  # unsigned 64-bit block checksum the entry carries
    req_id: str
    index: int
    tier: str
    key: str


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the model runner needs for one step.

    Before the forward pass the runner applies, in this order: ``swap_out`` (device ->
    host copies of requests preempted to the host tier; their device blocks may already
    be handed to others in this step, who write them in the forward pass), ``swap_in``
    (host -> device) and ``copy_blocks``, the copy-on-write pairs
    ``(src_block_id, dst_block_id)``. A step never has both swap-outs and swap-ins (the
    scheduler swaps nothing in during a step that preempted).

    ``requests`` lists the step's requests in step order, one ``ScheduledRequest`` each:
    decodes, prefill chunks, recomputes and swapped-in requests alike.
    """

    step_id: int
    requests: list[ScheduledRequest]
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    # Requests that left since the last step (finished, aborted or preempted), so a
    # runner holding per-request state can drop it.
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    swap_out: list[BlockSwap] = field(default_factory=list)
    swap_in: list[BlockSwap] = field(default_factory=list)
    # KV tiers (kvstore/): cached blocks evicted in this step's scheduling, to copy out
    # before anything else touches the pool, and verified tier entries to copy into fresh
    # blocks after the swap-ins (see ``TierLoad``).
    offload: list[EvictedBlock] = field(default_factory=list)
    tier_loads: list[TierLoad] = field(default_factory=list)
    # Blocks that went FREE without a hash since the last step (``BlockPool.take_dead``):
    # nothing reads them before a new life rewrites them, so the runner unseals them
    # after ``swap_out`` (the integrity scrubber then re-verifies only live content).
    dead_blocks: list[int] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Total tokens computed this step."""
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probability of a sampled token and of the top-k alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first
    rank: int | None = None  # 1 + tokens more likely than it; None: not computed


#: What a failed check found: stored K/V bytes changed ("checksum"); a slot holds
#: another token chain's K/V: wrong block id, wrong slot, or corrupted tag ("slot_tag");
#: a new token was written to a slot attention does not read it from ("slot_mapping");
#: blocks held by more tables than their reference count ("refcount", from an audit).
FaultKind = Literal["checksum", "slot_tag", "slot_mapping", "refcount"]
#: Which check found it: verified before use in this step ("read"), on a prefix-cache
#: hit ("reuse"), a block's slots at seal time ("seal"), the background scrubber
#: ("scrub"), a block coming back from the host tier ("swap_in"), the write-index check
#: after the forward pass ("write"), or the invariant audit ("audit").
Finder = Literal["read", "reuse", "seal", "scrub", "swap_in", "write", "audit", "tier_load"]
#: A metadata fault the scheduler catches itself: a table entry's block was freed under
#: it ("stale_ref"), a table's block id disagrees with its reference ("table_mismatch"),
#: or a block a table holds was on the free queue ("free_list": taken off it, nothing
#: recomputed).
TableFaultKind = Literal["stale_ref", "table_mismatch", "free_list"]


class FailureKey(NamedTuple):
    """The key of a failed-check counter: what was found and which check found it.
    Table faults are found before a step ("schedule"), when a table is freed ("free"),
    or when the pool refuses to hand out a block still referenced ("allocate")."""

    kind: FaultKind | TableFaultKind
    found_by: Finder | Literal["schedule", "free", "allocate"]


@dataclass(frozen=True, slots=True)
class KVFault:
    """One integrity check that failed in the worker.

    ``block_ids`` are the physical blocks that failed; ``rollback`` maps each request
    whose reads went through a failed block this step to the token position it must be
    recomputed from (the start of the first failed block in its table).
    """

    kind: FaultKind
    block_ids: tuple[int, ...]
    rollback: dict[str, int]
    found_by: Finder
    detail: str = ""


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens ``start .. start + len(entries) - 1`` (``start >= 1``:
    the first prompt token has none), each from the raw logits of the position before
    it (no penalties, temperature or bias)."""

    start: int
    entries: list[TokenLogprobs]


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """What one step produced: a token for each request scheduled with ``sample=True``.

    A request listed in any ``faults[i].rollback`` read corrupted KV: it has no sampled
    token this step (none is ever released from bad KV) and the scheduler recomputes it.
    """

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    faults: list[KVFault] = field(default_factory=list)
    # Prompt logprobs of the chunks scheduled with ``score_prompt`` that read no bad KV.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


@dataclass(slots=True)
class RequestUpdate:
    """What one step produced for one request that sampled a token; read-only once built
    (not frozen, as ``ScheduledRequest``)."""

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
