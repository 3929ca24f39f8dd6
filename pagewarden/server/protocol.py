"""Request bodies of the OpenAI API as pydantic models: strict types, lenient shape.

Lenient where the OpenAI API and vLLM are (``OpenAIRequest``, the base of every body):

- an explicit ``null`` means "the default" for every optional field (``"n": null`` is
  ``n = 1``); a field whose own type includes None keeps the None it was sent;
- a field this server does not know is accepted, kept in ``model_extra`` and logged once
  per field name (as vLLM does); known fields are validated strictly (types, no NaN).

Fields that current OpenAI clients send and that have no effect here (``user``,
``metadata``, ``prompt_cache_key``, ``safety_identifier``, ``reasoning_effort``,
``modalities``, ``prediction``, ...) are accepted and ignored. Fields that ask for a
feature an endpoint does not implement (``NOT_SUPPORTED``: tools on completions, say) are
refused with a 400 naming them (``unsupported_field``), never silently dropped. Numeric ranges are
checked by ``SamplingParams`` and the server's limits (``responses.py``).
"""

from __future__ import annotations

import logging
import threading
import types
import typing
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger("pagewarden.server")

_LENIENT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
#: Nested objects whose shape is ours to check (a response_format, a schema spec).
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

#: Unknown field names are logged once each, up to this many names (a client sending
#: random names must not grow the set without bound).
MAX_LOGGED_UNKNOWN_FIELDS = 256
_logged_unknown: set[str] = set()
_logged_lock = threading.Lock()


def _accepts_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(_accepts_none(a) for a in typing.get_args(annotation))
    return False


def _log_unknown(model: str, names: list[str]) -> None:
    with _logged_lock:
        new = [n for n in names if n not in _logged_unknown]
        room = MAX_LOGGED_UNKNOWN_FIELDS - len(_logged_unknown)
        new = new[: max(room, 0)]
        _logged_unknown.update(new)
    for name in new:
        logger.warning(
            "ignoring field %r of a %s request: not known to this server (logged once per "
            "field name)",
            name[:100],
            model,
        )


class OpenAIRequest(BaseModel):
    """Base of every request body: nulls mean defaults, unknown fields are logged."""

    model_config = _LENIENT
    # Optional fields where null means the default (their type does not take None).
    _null_is_default: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._null_is_default = frozenset(
            name
            for name, f in cls.model_fields.items()
            if not f.is_required() and not _accepts_none(f.annotation)
        )

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(v is None for v in data.values()):
            drop = cls._null_is_default
            return {k: v for k, v in data.items() if v is not None or k not in drop}
        return data

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> OpenAIRequest:
        if self.model_extra:
            _log_unknown(type(self).__name__, list(self.model_extra))
        return self


#: Fields that ask for what an endpoint does not do, with the values that ask for nothing
#: (None, empty, and the listed ones): sent to an endpoint whose model does not declare
#: them (tools on /v1/completions, say), any other value is a 400 naming the field.
NOT_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "tools": (),
    "tool_choice": ("none", "auto"),
    "functions": (),
    "function_call": ("none", "auto"),
}


def unsupported_field(req: BaseModel) -> str | None:
    """The first unknown field of ``req`` that asks for a feature its endpoint lacks (a
    declared field is implemented there)."""
    extra = req.model_extra or {}
    for name, harmless in NOT_SUPPORTED.items():
        if name in type(req).model_fields:
            continue
        value = extra.get(name)
        if value is None or value in ((), [], {}, "") or value in harmless:
            continue
        return name
    return None


class StreamOptions(OpenAIRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# ---- structured outputs and tools (issue 31, items 1 and 2) ---------------------------


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM options with no effect on xgrammar's output here, accepted
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"] = "function"
    function: FunctionName


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class _StructuredFields(OpenAIRequest):
    """Structured outputs, on completions and chat: OpenAI's ``response_format``, vLLM's
    ``structured_outputs`` and its deprecated ``guided_*`` aliases (at most one)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None


class _SamplingFields(_StructuredFields):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # None: the (one) served model
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias
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
    max_tokens: int | None = 16  # 0 only with echo: score the prompt, generate nothing
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM: top alternatives per prompt token
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # None (or absent) only beside tool calls: checked in server/tools.py.
    content: str | list[TextPart] | None = None
    name: str | None = None
    # tools: an assistant's calls, and a tool result's call id
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: ToolCallFunction | None = None  # legacy functions

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def text_length(self) -> int:
        """``len(self.text())`` without building it."""
        if self.content is None:
            return 0
        if isinstance(self.content, str):
            return len(self.content)
        return sum(len(p.text) for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM: the rendered prompt's token logprobs
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    echo: bool = False  # vLLM: the last message's content before the reply (server/chat.py)
    # accepted and ignored (OpenAI chat fields with no effect here)
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # tools (server/tools.py); functions / function_call are the legacy spelling
    tools: list[ChatTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDefinition] | None = Field(default=None, max_length=128)
    function_call: Literal["none", "auto"] | FunctionName | None = None


# ---- the Responses API (issue 31, item 6: /v1/responses; server/responses_api.py) ------


class ResponsesTextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    format: ResponsesTextFormat | None = None


class ResponsesRequest(OpenAIRequest):
    """``POST /v1/responses``: OpenAI's Responses API, stateless (nothing is stored)."""

    model: str
    input: str | list[dict[str, Any]] = Field(max_length=4096)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: ResponsesText | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    # accepted and ignored (OpenAI fields with no effect here)
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class TokenizeRequest(OpenAIRequest):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` rendered by the chat
    template as ``/v1/chat/completions`` renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    # None: True for a prompt, False for messages (the template writes BOS), as vLLM
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # with messages: rendered as on /v1/chat/completions (tools are in the prompt there)
    tools: list[ChatTool] | None = Field(default=None, max_length=128)
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIRequest):
    """vLLM's ``/detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]
