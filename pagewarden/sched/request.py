"""A request as the scheduler tracks it: tokens, progress, status."""

from __future__ import annotations

import enum
import time

from pagewarden.sampling_params import SamplingParams

#: Child seed = parent seed * _SEED_MIX + child index (n > 1).
_SEED_MIX = 1000003


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV in the host tier
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


def stop_token_set(params: SamplingParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """Tokens that finish a request once it has ``min_tokens`` outputs: the stop token ids,
    plus the EOS ids unless ``ignore_eos``."""
    stop = frozenset(params.stop_token_ids or ())
    return stop if params.ignore_eos else stop | eos_token_ids


class Request:
    """One sequence to generate.

    ``all_token_ids`` is ``prompt_token_ids + output_token_ids`` kept in step (the tokens
    whose K/V a step computes); ``num_computed_tokens`` of them are in the KV cache.
    Invariant: ``0 <= num_computed_tokens <= num_tokens``. A request with ``n > 1`` and
    no ``parent_id`` is a fork parent: it prefills ``prompt[:-1]`` and then becomes its
    children ``f"{req_id}#{i}"``. ``stop_ids`` is ``stop_token_set`` of its parameters
    (resolved again at admission, with ``max_tokens``).
    """

    __slots__ = (
        "req_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "sampling_params",
        "eos_token_ids",
        "cache_salt",
        "arrival_time",
        "num_computed_tokens",
        "status",
        "finish_reason",
        "stop_reason",
        "parent_id",
        "index",
        "num_cached_tokens",
        "max_tokens",
        "seed",
        "extra_keys",
        "num_preemptions",
        "stop_ids",
        "num_prompt_tokens",
        "rope_long",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)  # the prompt never changes
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.parent_id: str | None = None
        self.index = 0
        self.num_cached_tokens = 0
        # Resolved by the scheduler at admission (max_tokens=None -> up to max_model_len).
        self.max_tokens = sampling_params.max_tokens or 0
        self.seed = sampling_params.seed
        self.extra_keys = b""
        self.num_preemptions = 0
        self.stop_ids = stop_token_set(sampling_params, self.eos_token_ids)
        # Rotated with the model's long RoPE factors (set by the scheduler from its
        # length; see SchedulerConfig.rope_switch_tokens).
        self.rope_long = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_computable_tokens(self) -> int:
        """How many of its tokens should have K/V computed: all of them, or
        ``prompt[:-1]`` for a fork parent (each child computes the last prompt token)."""
        if self.is_fork_parent:
            return self.num_prompt_tokens - 1
        return len(self.all_token_ids)

    @property
    def is_fork_parent(self) -> bool:
        return self.sampling_params.n > 1 and self.parent_id is None

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def make_children(self) -> list[Request]:
        """The ``n`` children of a fork parent, ``f"{req_id}#{i}"``, at its progress.

        Child ``i`` samples with seed ``seed * _SEED_MIX + i`` (None stays None), so the
        children of a seeded request differ from each other and are reproducible.
        """
        params = self.sampling_params
        children = []
        for i in range(params.n):
            child = Request(
                f"{self.req_id}#{i}",
                self.prompt_token_ids,
                params,
                self.eos_token_ids,
                self.cache_salt,
                self.arrival_time,
            )
            child.parent_id = self.req_id
            child.index = i
            child.max_tokens = self.max_tokens
            child.stop_ids = self.stop_ids
            child.extra_keys = self.extra_keys
            child.rope_long = self.rope_long
            child.seed = None if params.seed is None else params.seed * _SEED_MIX + i
            child.num_cached_tokens = self.num_cached_tokens
            child.num_computed_tokens = self.num_computed_tokens
            children.append(child)
        return children

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
