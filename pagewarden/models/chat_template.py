"""Chat templates: the model's Jinja template rendered in a sandbox, as transformers does.

Templates come with the model (GGUF `tokenizer.chat_template`, HF `tokenizer_config.json`
or `chat_template.jinja`) or from the user (`--chat-template`), so they are untrusted
code: they run in jinja2's `ImmutableSandboxedEnvironment`, with the environment and
helpers of transformers' `apply_chat_template` so the same template renders the same
text: `trim_blocks` and `lstrip_blocks`, loop controls, the `{% generation %}` tag (its
body is rendered as is), `raise_exception`, `strftime_now`, a `tojson` that does not
escape HTML and keeps non-ASCII, and `dict` and `namespace` that refuse dunder names.

The template sees `messages` (keys whose value is None dropped; a message's reasoning is
also offered as `reasoning_content` and `thinking`), `tools`, `documents`,
`add_generation_prompt`, the special tokens (`bos_token`, `eos_token`, ...) and any
extra keyword arguments (`chat_template_kwargs`), which override the special tokens.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template cannot be read, compiled or rendered for these messages."""


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without attribute access to the dict type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's own signature
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
            )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e} (line {e.lineno})") from e


def _message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ChatTemplateError(f"a chat message must be a dict, got {type(message).__name__}")
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render `messages` with the template `source` (see the module docstring)."""
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    reserved = {"messages", "tools", "documents", "add_generation_prompt"} & set(template_kwargs)
    if reserved:
        raise ChatTemplateError(f"chat template variables {sorted(reserved)} cannot be overridden")
    context = {**special_tokens, **template_kwargs}
    try:
        return _compile(source).render(
            messages=[_message(m) for m in messages],
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(str(e)) from e


@lru_cache(maxsize=32)
def template_variables(source: str) -> frozenset[str]:
    """The names `source` reads from its render context (not those it sets itself): a
    template renders tools natively when `tools` is among them. Empty if it does not
    compile (rendering it then fails with the reason)."""
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateSyntaxError:
        return frozenset()


def read_chat_template(value: str) -> str:
    """A `--chat-template` value: the path of a template file, or the template itself."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a long inline template is not a valid path name
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise ChatTemplateError(
        f"--chat-template {value!r}: no such file, and not a template (no '{{' or newline)"
    )
