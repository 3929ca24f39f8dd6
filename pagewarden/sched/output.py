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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from pagewarden.kv.swap_space import BlockSwap
from pagewarden.sampling_params import SamplingParams


def slot_mapping_for(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Physical slots of positions ``[start, end)``, one contiguous run per block::

    block_size = 4, block_ids = [7, 3], positions 2..6
    block 7 (slots 28..31): 30, 31        offsets 2, 3
    block 3 (slots 12..15): 12, 13, 14    offsets 0, 1, 2
    """
    if start >= end:
        return []
    first, offset = divmod(start, block_size)
    last = (end - 1) // block_size
    base = block_ids[first] * block_size
    if first == last:
        return list(range(base + offset, base + offset + end - start))
    slots = list(range(base + offset, base + block_size))
    extend = slots.extend
    for block_id in block_ids[first + 1 : last]:
        base = block_id * block_size
        extend(range(base, base + block_size))
    base = block_ids[last] * block_size
    extend(range(base, base + end - last * block_size))
    return slots


class SlotRun(Sequence[int]):
    """The physical slots of positions ``[start, end)`` through ``block_table``: a
    read-only sequence listed on first use (``slot_mapping_for``).

    A prefill chunk's slot list is most of what its ``ScheduledRequest`` costs the
    scheduler to build, and only the worker reads it. ``block_table`` is never mutated
    (tables are replaced, not changed), so the list is the same whenever it is made.
    Compares equal to a list (or another run) with the same slots.
    """

    __slots__ = ("block_table", "block_size", "start", "end", "_slots")

    def __init__(self, block_table: list[int], block_size: int, start: int, end: int) -> None:
        self.block_table = block_table
        self.block_size = block_size
        self.start = start
        self.end = end
        self._slots: list[int] | None = None

    def tolist(self) -> list[int]:
        slots = self._slots
        if slots is None:
            slots = self._slots = slot_mapping_for(
                self.block_table, self.block_size, self.start, self.end
            )
        return slots

    def __len__(self) -> int:
        return max(0, self.end - self.start)

    def __getitem__(self, index):  # type: ignore[override]
        return self.tolist()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SlotRun):
            return self.tolist() == other.tolist()
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SlotRun({self.tolist()!r})"


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step.

    ``token_ids[i]`` sits at ``positions[i]`` and its K/V goes to ``slot_mapping[i]``.
    Attention for these tokens reads positions ``[0, positions.stop)`` through
    ``block_table``. ``prompt_token_ids`` and ``output_token_ids`` are read-only views for
    penalties; the runner must not mutate them.
    """

    req_id: str
    token_ids: list[int]
    positions: range
    block_table: list[int]
    slot_mapping: list[int] | SlotRun  # a SlotRun for chunks the scheduler builds
    # True when this chunk ends at the last known token, so a token is sampled from it.
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Seed for this request's sampling noise (the child index of n > 1 is already mixed
    # in); None means "use the engine's generator".
    seed: int | None = None

    @property
    def num_context_tokens(self) -> int:
        """Tokens already in the KV cache before this step."""
        return self.positions.start

    @property
    def sample_index(self) -> int:
        """Index of the output token sampled this step (for seeded determinism)."""
        return len(self.output_token_ids)


@dataclass(frozen=True, slots=True)
class SamplingInputs:
    """What sampling needs of a request besides its logits; one object for the request's
    whole life (``output_token_ids`` is a live, read-only view that grows)."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int | None


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """The step's plain decodes as parallel lists: requests that compute one token into a
    block they own alone and sample from it.

    Entry ``i`` means ``ScheduledRequest(req_ids[i], [token_ids[i]],
    range(positions[i], positions[i] + 1), block_tables[i], [slot_mapping[i]], True,
    ...inputs[i])``; ``scheduled_requests()`` builds exactly those. Most of a busy step is
    decodes, and a column append costs a fraction of building one object per request.
    The slots are derived from the tables on demand, where the runner wants them.
    """

    block_size: int
    req_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    inputs: list[SamplingInputs] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.req_ids)

    @property
    def slot_mapping(self) -> list[int]:
        """The physical slot each entry's token writes: ``table[p // bs] * bs + p % bs``."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for table, p in zip(self.block_tables, self.positions)]

    def scheduled_requests(self) -> list[ScheduledRequest]:
        """The same entries as ``ScheduledRequest`` objects, in order."""
        return [
            ScheduledRequest(
                rid,
                [tok],
                range(pos, pos + 1),
                table,
                [slot],
                True,
                inp.sampling_params,
                inp.prompt_token_ids,
                inp.output_token_ids,
                inp.seed,
            )
            for rid, tok, pos, slot, table, inp in zip(
                self.req_ids,
                self.token_ids,
                self.positions,
                self.slot_mapping,
                self.block_tables,
                self.inputs,
            )
        ]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the model runner needs for one step.

    Before the forward pass the runner applies, in this order: ``swap_out`` (device ->
    host copies of requests preempted to the host tier; their device blocks may already
    be handed to others in this step, who write them in the forward pass), ``swap_in``
    (host -> device) and ``copy_blocks``, the copy-on-write pairs
    ``(src_block_id, dst_block_id)``. A step never has both swap-outs and swap-ins (the
    scheduler swaps nothing in during a step that preempted).

    The step's requests are ``decodes`` (plain decodes, in columns) followed by
    ``requests`` (everything else: prefill chunks, copy-on-write decodes, swapped-in
    requests); ``all_requests()`` lists them all as ``ScheduledRequest`` objects.
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
    # Plain decodes, columnar; in step order they come before ``requests``.
    decodes: DecodeBatch = field(default_factory=lambda: _NO_DECODES)

    @property
    def num_batched_tokens(self) -> int:
        """Total tokens computed this step."""
        return len(self.decodes.req_ids) + sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.decodes.req_ids

    def all_requests(self) -> list[ScheduledRequest]:
        """Every scheduled request in step order: the decodes, then ``requests``."""
        if not self.decodes.req_ids:
            return self.requests
        return self.decodes.scheduled_requests() + self.requests

    def materialized(self) -> SchedulerOutput:
        """The same step with the decodes folded into ``requests`` (an empty decode
        batch), for code that works one ``ScheduledRequest`` at a time."""
        if not self.decodes.req_ids:
            return self
        return replace(self, requests=self.all_requests(), decodes=_NO_DECODES)


#: The empty decode batch (its lists are never appended to).
_NO_DECODES = DecodeBatch(0)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probability of a sampled token and of the top-k alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass(frozen=True, slots=True)
class KVFault:
    """One integrity check that failed in the worker.

    ``kind`` is "checksum" (stored K/V bytes changed) or "slot_tag" (a slot holds another
    token chain's K/V: wrong block id, wrong slot, or corrupted tag). ``block_ids`` are the
    physical blocks that failed; ``rollback`` maps each request whose reads went through
    a failed block this step to the token position it must be recomputed from (the start
    of the first failed block in its table). ``found_by`` names the check: "read"
    (verified before use in this step), "reuse" (a prefix-cache hit), "seal" (a block's
    slots at seal time) or "scrub" (the background scrubber).
    """

    kind: str
    block_ids: tuple[int, ...]
    rollback: dict[str, int]
    found_by: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """What one step produced: a token for each request scheduled with ``sample=True``.

    A request listed in any ``faults[i].rollback`` read corrupted KV: it has no sampled
    token this step (none is ever released from bad KV) and the scheduler recomputes it.
    """

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    faults: list[KVFault] = field(default_factory=list)
    # The decode batch's tokens in its order, for a runner that answers it in columns
    # (and found no fault); empty when they are in ``sampled_token_ids`` like the rest.
    decode_token_ids: list[int] = field(default_factory=list)
