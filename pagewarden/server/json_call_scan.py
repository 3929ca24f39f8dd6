"""An incremental scanner for one tool call written as a JSON object,
``{"name": "f", "arguments": {...}}``, as a model generates it.

The text grows by a few characters per engine step; ``CallScanner.scan`` reads only what
is new, so a streamed choice costs linear time in its length. The scanner knows where the
call's pieces lie in the caller's text, as offsets::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Pa
               ^start        name ok   args_start ^          ^ args_end (still open)

Only the object's own members (depth 1) are tracked; a member value is skipped by
counting brackets outside strings. The scanner checks the structure, not every literal:
a finished call's text is parsed with ``json.loads`` before it is trusted (``valid``).
"""

from __future__ import annotations

import json
from enum import Enum

_WS = " \t\n\r"


def _decode(literal: str) -> str | None:
    """A JSON string literal's value; None if it is not one (a bad escape, say)."""
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class _At(Enum):
    OPEN = "open"  # before the object's "{"
    KEY_OR_CLOSE = "key_or_close"  # after "{"
    KEY_START = "key_start"  # after ","
    KEY = "key"  # inside a member name
    COLON = "colon"
    VALUE_START = "value_start"
    VALUE = "value"  # inside a member value
    COMMA_OR_CLOSE = "comma_or_close"
    DONE = "done"
    ERROR = "error"


class CallScanner:
    """One call object scanned from offset ``start`` of a growing text.

    ``name`` is set once the ``"name"`` member's string is closed; ``args_start`` /
    ``args_end`` span the raw text of the first member named in ``args_keys`` seen so far
    (``args_closed`` once its value ended); ``end`` is the offset after the closing
    ``}``. A text that cannot be a call object puts the scanner in ``error``.
    """

    def __init__(self, start: int, args_keys: tuple[str, ...]) -> None:
        self.start = start
        self.pos = start  # the next character to read
        self.args_keys = args_keys
        self.at = _At.OPEN
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_closed = False
        self.end: int | None = None
        self._key_start = 0
        self._key: str | None = None
        self._value_start = 0
        self._kind = ""  # the current value: "container" | "string" | "scalar"
        self._depth = 0  # brackets open inside a container value
        self._in_string = False
        self._escaped = False
        self._text = ""

    @property
    def done(self) -> bool:
        return self.at is _At.DONE

    @property
    def error(self) -> bool:
        return self.at is _At.ERROR

    def scan(self, text: str) -> None:
        """Read ``text[self.pos:]`` (``text`` only ever grows)."""
        self._text = text
        while self.pos < len(text) and self.at not in (_At.DONE, _At.ERROR):
            self._step(text[self.pos])

    def valid(self, text: str) -> bool:
        """Whether the finished call parses as JSON with a string ``name``."""
        if not self.done or self.name is None:
            return False
        try:
            json.loads(text[self.start : self.end])
        except ValueError:
            return False
        return True

    def arguments(self, text: str) -> str:
        """The arguments of a finished call as JSON text: the model's own text, a string
        value decoded, ``{}`` when there are none."""
        if self.args_start is None or self.args_end is None:
            return "{}"
        raw = text[self.args_start : self.args_end]
        decoded = _decode(raw) if raw.startswith('"') else None
        return raw if decoded is None else decoded

    # ---- the state machine -----------------------------------------------------------

    def _step(self, ch: str) -> None:
        at = self.at
        if at is _At.VALUE:
            self._value_char(ch)
            return
        if at is _At.KEY:
            if self._string_char(ch):
                self._key = _decode(self._text[self._key_start : self.pos + 1])
                self.at = _At.COLON if self._key is not None else _At.ERROR
            self.pos += 1
            return
        self.pos += 1
        if ch in _WS:
            return
        if at is _At.OPEN:
            self.at = _At.KEY_OR_CLOSE if ch == "{" else _At.ERROR
        elif at in (_At.KEY_OR_CLOSE, _At.KEY_START):
            if ch == '"':
                self._key_start, self.at, self._escaped = self.pos - 1, _At.KEY, False
            elif ch == "}" and at is _At.KEY_OR_CLOSE:
                self._close()
            else:
                self.at = _At.ERROR
        elif at is _At.COLON:
            self.at = _At.VALUE_START if ch == ":" else _At.ERROR
        elif at is _At.VALUE_START:
            self._begin_value(ch)
        elif at is _At.COMMA_OR_CLOSE:
            if ch == ",":
                self.at = _At.KEY_START
            elif ch == "}":
                self._close()
            else:
                self.at = _At.ERROR

    def _begin_value(self, ch: str) -> None:
        self._value_start = self.pos - 1
        if self._key in self.args_keys and self.args_start is None:
            self.args_start = self.args_end = self._value_start
        self.at = _At.VALUE
        if ch in "{[":
            self._kind, self._depth = "container", 1
        elif ch == '"':
            self._kind, self._escaped = "string", False
        elif ch in "-0123456789tfn":
            self._kind = "scalar"
        else:
            self.at = _At.ERROR
            return
        self._grow_args()

    def _value_char(self, ch: str) -> None:
        if self._kind == "scalar" and (ch in _WS or ch in ",}"):
            self._end_value()  # the delimiter is read again as COMMA_OR_CLOSE
            return
        self.pos += 1
        self._grow_args()
        if self._kind == "string":
            if self._string_char(ch):
                self._end_value()
        elif self._kind == "container":
            if self._in_string:
                self._string_char(ch)
            elif ch == '"':
                self._in_string, self._escaped = True, False
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end_value()

    def _string_char(self, ch: str) -> bool:
        """Feed one character of an open string; True when it closes the string."""
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False
            return True
        return False

    def _end_value(self) -> None:
        if self._key == "name" and self.name is None and self._kind == "string":
            self.name = _decode(self._text[self._value_start : self.pos])
        if self.args_start == self._value_start:
            self.args_closed = True
        self.at = _At.COMMA_OR_CLOSE

    def _grow_args(self) -> None:
        if self.args_start is not None and self.args_start == self._value_start:
            self.args_end = self.pos

    def _close(self) -> None:
        self.end = self.pos
        self.at = _At.DONE
