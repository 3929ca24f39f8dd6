"""Tool-call parsers: a model's tool-call format back into OpenAI tool calls, whole or as
it streams (``--enable-auto-tool-choice --tool-call-parser NAME``, as vLLM; and the JSON
list that ``tool_choice: "required"`` forces).

A parser reads a choice's growing text with ``feed`` and answers the deltas that are
now certain, in the shape the ``openai`` client assembles (as vLLM's parsers stream them):

- ``{"content": "..."}`` for text before the first call (a possible tag start held back);
- ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}``
  once a call's name is complete;
- ``{"tool_calls": [{"index", "function": {"arguments": "..."}}]}`` as the arguments'
  text is generated: the model's own text, so the pieces add up to exactly what
  ``parse`` answers for the same text.

``parse`` (a finished output, not streamed) is ``feed`` over the whole text, plus the
check that every call is complete and valid JSON; when one is not, the whole text is
content, as before. Streaming cannot take back what it sent: a call the model breaks off
mid-way has already been streamed in part.

A format is a class with a ``_frame`` method (what lies around the call objects) and
one line in ``TOOL_PARSERS``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from pagewarden.server.json_call_scan import CallScanner

_WS = " \t\n\r"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # text outside the tool calls; None when there is none
    tool_calls: list[ParsedToolCall]


@dataclass
class _Call:
    scanner: CallScanner
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    header_sent: bool = False
    args_sent: int = 0  # offset in the text up to which arguments went out


def _held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class StreamingToolParser:
    """The shared machinery: calls scanned one after another, deltas for each.

    ``max_calls``: ``parallel_tool_calls: false`` keeps the first call and ignores what
    follows it.
    """

    args_keys: tuple[str, ...] = ("arguments",)

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls: list[_Call] = []
        self.pos = 0  # the next character the framing reads
        self.state = "start"
        self.content_sent = 0
        self.content_end: int | None = None  # where content stops: the first call's tag
        self.broken = False  # text that cannot be calls (nothing of them sent yet)
        self.stopped = False  # the rest of the text is ignored

    # ---- what callers use --------------------------------------------------------------

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """Deltas for ``text``, the whole output so far; ``final``: it is complete."""
        out: list[dict] = []
        while not self.stopped:
            call = self.calls[-1] if self.calls else None
            if call is not None and not call.scanner.done and not call.scanner.error:
                call.scanner.scan(text)
                out += self._call_deltas(call, text)
                if call.scanner.error or (call.scanner.done and call.scanner.name is None):
                    self._break()
                elif call.scanner.done:
                    self.pos = call.scanner.end or self.pos
                    if self.max_calls is not None and len(self.calls) >= self.max_calls:
                        self.stopped = True
                    continue
                break
            if not self._frame(text, final):
                break
        out += self._content_deltas(text, final)
        return out

    def parse(self, text: str) -> ParsedOutput:
        """The content and calls of a finished output."""
        self.feed(text, final=True)
        if self.broken or not self.calls or not all(c.scanner.valid(text) for c in self.calls):
            return ParsedOutput(text, [])
        head = text[: self.content_end].strip() if self.content_end is not None else ""
        return ParsedOutput(
            head or None,
            [ParsedToolCall(c.scanner.name or "", c.scanner.arguments(text)) for c in self.calls],
        )

    @property
    def called(self) -> bool:
        """Whether any tool call went out (the finish reason is then ``tool_calls``)."""
        return any(c.header_sent for c in self.calls)

    # ---- for the formats ---------------------------------------------------------------

    def _frame(self, text: str, final: bool) -> bool:
        """Read the text around the calls from ``self.pos``; start a call with
        ``_open_call``. False when nothing more can be read yet."""
        raise NotImplementedError

    def _open_call(self, at: int, content_end: int) -> None:
        """A call object starts at ``at``; the content (if no call came before) ends at
        ``content_end``."""
        if self.content_end is None:
            self.content_end = content_end
        self.calls.append(_Call(CallScanner(at, self.args_keys)))

    def _skip_ws(self, text: str) -> bool:
        """Skip whitespace; True if a character follows."""
        while self.pos < len(text) and text[self.pos] in _WS:
            self.pos += 1
        return self.pos < len(text)

    def _break(self) -> None:
        """The text is not a call after all."""
        if not self.called:
            self.broken = True
        self.stopped = True

    # ---- deltas ------------------------------------------------------------------------

    def _call_deltas(self, call: _Call, text: str) -> list[dict]:
        s, index = call.scanner, self.calls.index(call)
        out = []
        if not call.header_sent and s.name is not None:
            call.header_sent = True
            head = {"name": s.name, "arguments": ""}
            out.append(
                {
                    "tool_calls": [
                        {"index": index, "id": call.id, "type": "function", "function": head}
                    ]
                }
            )
        if not call.header_sent:
            return out
        piece = ""
        if s.args_start is None:
            if s.done and call.args_sent == 0:  # no arguments member: an empty object
                piece, call.args_sent = "{}", 1
        elif text[s.args_start] == '"':  # arguments as a JSON string: sent once decoded
            if s.args_closed and call.args_sent == 0:
                piece, call.args_sent = s.arguments(text), 1
        else:
            start = max(call.args_sent, s.args_start)
            end = start if s.args_end is None else s.args_end
            piece, call.args_sent = text[start:end], max(end, call.args_sent)
        if piece:
            out.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        return out

    def _content_deltas(self, text: str, final: bool) -> list[dict]:
        if self.broken:
            end = len(text)
        elif self.content_end is not None:
            end = self.content_end
        else:
            end = len(text) if final else self._content_safe_end(text)
        if end <= self.content_sent:
            return []
        piece = text[self.content_sent : end]
        self.content_sent = end
        return [{"content": piece}]

    def _content_safe_end(self, text: str) -> int:
        """How much of ``text`` is surely content while no call has started."""
        return len(text)


class HermesToolParser(StreamingToolParser):
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
    number of them, after optional text (text after the first call is dropped)."""

    TAG, END_TAG = "<tool_call>", "</tool_call>"

    def _frame(self, text: str, final: bool) -> bool:
        if self.state in ("start", "between"):
            at = text.find(self.TAG, self.pos)
            if at < 0:
                return False
            self._open_call(at + len(self.TAG), at)
            self.state = "call"
            return True
        # after a call: its closing tag (or, leniently, none), then the next call
        if not self._skip_ws(text):
            return False
        if text.startswith(self.END_TAG, self.pos):
            self.pos += len(self.END_TAG)
        elif self.END_TAG.startswith(text[self.pos :]) and not final:
            return False
        self.state = "between"
        return True

    def _content_safe_end(self, text: str) -> int:
        return len(text) - _held_prefix(text, self.TAG)


class Llama3JsonToolParser(StreamingToolParser):
    """Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}``, optionally after
    ``<|python_tag|>``, several separated by ``;``; the whole output is the calls."""

    TAG = "<|python_tag|>"
    args_keys = ("parameters", "arguments")

    def _frame(self, text: str, final: bool) -> bool:
        if not self._skip_ws(text):
            return False
        rest = text[self.pos :]
        if self.state == "start":
            if rest.startswith(self.TAG):
                self.pos += len(self.TAG)
                self.state = "tagged"
                return True
            if self.TAG.startswith(rest) and not final:
                return False
        if self.state in ("start", "tagged", "sep") and rest[0] == "{":
            self._open_call(self.pos, 0)
            self.state = "after"
            return True
        if self.state == "after" and rest[0] == ";":
            self.pos += 1
            self.state = "sep"
            return True
        self._break()  # not a call: all of it is content (or, after calls, ignored)
        return False

    def _content_safe_end(self, text: str) -> int:
        return self.content_sent  # content only once it is sure not to be a call


class RequiredToolParser(StreamingToolParser):
    """What ``tool_choice: "required"`` forces: ``[{"name": ..., "parameters": {...}},
    ...]``."""

    args_keys = ("parameters",)

    def _frame(self, text: str, final: bool) -> bool:
        if not self._skip_ws(text):
            return False
        ch = text[self.pos]
        if self.state == "start" and ch == "[":
            self.pos += 1
            self.state = "item"
        elif self.state == "item" and ch == "{":
            self._open_call(self.pos, 0)
            self.state = "after"
        elif self.state == "after" and ch == ",":
            self.pos += 1
            self.state = "item"
        elif self.state == "after" and ch == "]":
            self.stopped = True
            return False
        else:
            self._break()
            return False
        return True

    def _content_safe_end(self, text: str) -> int:
        return self.content_sent


#: Parsers by ``--tool-call-parser`` name (vLLM's names).
TOOL_PARSERS: dict[str, type[StreamingToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
