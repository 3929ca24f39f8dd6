"""Request bodies of the OpenAI API as pydantic models (strict types, unknown fields 400).

Fields that current OpenAI clients send and that have no effect here (``user``,
``metadata``, ``prompt_cache_key``, ``safety_identifier``, ``reasoning_effort``,
``modalities``, ``prediction``, ...) are accepted and ignored, so stock clients work.
Numeric ranges are checked by ``SamplingParams`` and the server's limits (``responses.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _STRICT
    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # accepted and ignored (OpenAI fields with no effect here)
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required: OpenAI allows a missing content only beside tool calls, unsupported here.
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    # accepted and ignored (OpenAI chat fields with no effect here)
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    parallel_tool_calls: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
