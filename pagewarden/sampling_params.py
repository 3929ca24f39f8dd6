"""Sampling parameters, compatible with vLLM's ``SamplingParams``.

Pure Python (no torch): the scheduler reads ``n``, ``max_tokens``, ``ignore_eos`` and
``stop_token_ids``; the sampler reads the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagewarden.structured_outputs import StructuredOutputsParams

#: Temperatures below this are treated as greedy (argmax), as vLLM does.
GREEDY_EPSILON = 1e-5

# Hard bounds that hold whatever the model: a value outside them is never meaningful and
# could overflow a tensor (int64 top_k) or a float (a near-zero penalty divides logits).
# Bounds that depend on the model (top_k and logprobs by the vocabulary, min_tokens by
# the context) are checked by ``check_vocab`` and by the engine's request check.
MAX_N = 128
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_TOKEN_ID = 2**31 - 1  # larger than any vocabulary or context length
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
#: OpenAI's bounds on ``logit_bias``: at most 300 entries, each in [-100, 100].
MAX_LOGIT_BIAS_ENTRIES = 300
LOGIT_BIAS_RANGE = (-100.0, 100.0)


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the parameter."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check_int(name: str, value: object, lo: int, hi: int, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SamplingParamsError(
            name,
            f"{name} must be an integer in [{lo}, {hi}]{' ' + hint if hint else ''}, got {value!r}",
        )


def _check_float(name: str, value: object, lo: float, hi: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not lo <= value <= hi
    ):
        raise SamplingParamsError(name, f"{name} must be a number in [{lo}, {hi}], got {value!r}")


@dataclass
class SamplingParams:
    """How to sample one prompt's completions.

    Invariant (checked on construction): every field is within the range its docstring
    gives, so the sampler and scheduler never re-validate.

    Every numeric field is bounded (the constants above); ``check_vocab`` adds the bounds
    that depend on the model.

    ``top_k`` of 0 or -1 and ``max_tokens=None`` are accepted for vLLM compatibility and
    normalised to ``None`` ("no limit" / "up to the context length").
    """

    n: int = 1  # [1, MAX_N]
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # [0.01, 100]; 1 = off
    temperature: float = 1.0  # [0, 100]; < GREEDY_EPSILON = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int | None = None  # [1, vocab], or None for all tokens
    min_p: float = 0.0  # [0, 1]
    seed: int | None = None  # a signed 64-bit integer
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # >= 1, or None: until the context is full
    min_tokens: int = 0  # [0, max_tokens]
    logprobs: int | None = None  # top logprobs per token, [0, vocab]
    # Logprobs of the prompt's tokens (the first has none) with this many top
    # alternatives each, [0, vocab]; None: not computed.
    prompt_logprobs: int | None = None
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias):
    # at most 300 entries, ids in [0, vocab), values in [-100, 100].
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured outputs: the grammar the output must match (engine/grammar.py).
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p <= 0.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and not isinstance(self.top_k, bool) and self.top_k in (0, -1):
            self.top_k = None
        if self.top_k is not None:
            _check_int("top_k", self.top_k, 1, MAX_TOKEN_ID, "(or 0/-1 to disable)")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**63 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, MAX_TOKEN_ID)
        _check_int("min_tokens", self.min_tokens, 0, MAX_TOKEN_ID)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens} > "
                f"max_tokens {self.max_tokens}",
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_TOKEN_ID)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOKEN_ID)
        self._check_logit_bias()
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise SamplingParamsError("stop", "stop strings must be non-empty strings")
        if len(self.stop_strings) > MAX_STOP_STRINGS or any(
            len(s) > MAX_STOP_STRING_CHARS for s in self.stop_strings
        ):
            raise SamplingParamsError(
                "stop",
                f"at most {MAX_STOP_STRINGS} stop strings of at most "
                f"{MAX_STOP_STRING_CHARS} characters each",
            )
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids"
            )
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, MAX_TOKEN_ID)
        self._check_structured_outputs()

    def _check_structured_outputs(self) -> None:
        """A grammar ends with a stop token: settings that forbid one are refused."""
        if self.structured_outputs is None:
            return
        if not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError(
                "structured_outputs", "structured_outputs must be StructuredOutputsParams"
            )
        if self.ignore_eos:
            raise SamplingParamsError(
                "ignore_eos", "ignore_eos cannot be combined with structured outputs"
            )
        if self.min_tokens:
            raise SamplingParamsError(
                "min_tokens", "min_tokens cannot be combined with structured outputs"
            )

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError(
                "logit_bias",
                f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases",
            )
        for token_id, value in bias.items():
            _check_int("logit_bias", token_id, 0, MAX_TOKEN_ID, "(a token id)")
            _check_float("logit_bias", value, *LOGIT_BIAS_RANGE)
        if not bias:
            self.logit_bias = None

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``SamplingParamsError`` for a token-indexed parameter past the vocabulary."""
        if self.top_k is not None and self.top_k > vocab_size:
            raise SamplingParamsError(
                "top_k", f"top_k must be at most the vocabulary size {vocab_size}, got {self.top_k}"
            )
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise SamplingParamsError(
                "logprobs",
                f"logprobs must be at most the vocabulary size {vocab_size}, got {self.logprobs}",
            )
        if self.prompt_logprobs is not None and self.prompt_logprobs > vocab_size:
            raise SamplingParamsError(
                "prompt_logprobs",
                f"prompt_logprobs must be at most the vocabulary size {vocab_size}, "
                f"got {self.prompt_logprobs}",
            )
        bad_bias = [t for t in self.logit_bias or {} if t >= vocab_size]
        if bad_bias:
            raise SamplingParamsError(
                "logit_bias",
                f"logit_bias token ids must be below the vocabulary size {vocab_size}, "
                f"got {bad_bias[0]}",
            )
        bad = [t for t in self.stop_token_ids or [] if t >= vocab_size]
        if bad:
            raise SamplingParamsError(
                "stop_token_ids", f"stop_token_ids must be below {vocab_size}, got {bad[0]}"
            )

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature < GREEDY_EPSILON
