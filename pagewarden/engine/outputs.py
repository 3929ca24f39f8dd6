"""Request outputs, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagewarden.sched.output import TokenLogprobs


@dataclass
class CompletionOutput:
    """One of a prompt's ``n`` completions."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # With ``SamplingParams.prompt_logprobs``: one entry per prompt token, the first None;
    # set once the whole prompt is scored (with the first output token).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
