"""Sampling parameters, compatible with vLLM's ``SamplingParams``.

Pure Python (no torch): the scheduler reads ``n``, ``max_tokens``, ``ignore_eos`` and
``stop_token_ids``; the sampler reads the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Temperatures below this are treated as greedy (argmax), as vLLM does.
GREEDY_EPSILON = 1e-5


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the parameter."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to sample one prompt's completions.

    Invariant (checked on construction): every field is within the range its docstring
    gives, so the sampler and scheduler never re-validate.

    ``top_k`` of 0 or -1 and ``max_tokens=None`` are accepted for vLLM compatibility and
    normalised to ``None`` ("no limit" / "up to the context length").
    """

    n: int = 1
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    temperature: float = 1.0  # >= 0; < GREEDY_EPSILON = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int | None = None  # >= 1, or None for all tokens
    min_p: float = 0.0  # [0, 1]
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # >= 1, or None: until the context is full
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per token, >= 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise SamplingParamsError("n", f"n must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0.0:
            raise SamplingParamsError(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            )
        if self.temperature < 0.0:
            raise SamplingParamsError(
                "temperature", f"temperature must be >= 0, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k in (0, -1):
            self.top_k = None
        if self.top_k is not None and self.top_k < 1:
            raise SamplingParamsError(
                "top_k", f"top_k must be >= 1 (or 0/-1 to disable), got {self.top_k}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError(
                "max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}"
            )
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}",
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise SamplingParamsError("logprobs", f"logprobs must be >= 0, got {self.logprobs}")
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise SamplingParamsError("stop", "stop strings must be non-empty strings")
        if self.stop_token_ids is None:
            self.stop_token_ids = []

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature < GREEDY_EPSILON
