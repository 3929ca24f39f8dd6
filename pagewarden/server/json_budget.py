"""Refuse a request body by how many JSON values it holds, before parsing it.

Parsing costs per value, not per byte: pydantic builds a Python object for each, holding
the GIL (no parser pagewarden could use releases it, so a worker thread would not free
the event loop). A 9 MB string is one value and parses in a few milliseconds; the same
bytes as a 2M-entry token-id list take a quarter to one and a half seconds, and as 3M
empty arrays in an unknown field several seconds. So a body is sized by what it holds,
from its raw bytes, with C byte operations (``bytes.replace``, ``count``, ``split``), a
piece of ``PIECE_BYTES`` at a time with a turn of the event loop between pieces:

- escapes first: every ``\\\\`` pair, then every ``\\"`` pair, is dropped, which leaves
  exactly the quotes that open and close strings (a backslash inside a JSON string
  always starts a two-character escape, read left to right; a piece never ends on a
  backslash, so no escape is split);
- strings: those quotes / 2 (keys included);
- outside the strings, every value and key but the top-level one follows a ``[``, ``{``,
  ``,`` or ``:``, and each of those precedes at most one, so
  ``values <= count([ { , :) + 1`` (exact but for empty arrays and objects);
- ``costly``: arrays, objects, strings, and each ``.``, ``e`` or ``E`` outside strings
  (a float has one or two, ``true`` and ``false`` one): the values that cost several
  times an integer to build.

Two limits, both derived from the server's own:

- ``max_values``: every token id the completions route may take (``max_prompts_per_request``
  prompts of ``max_model_len`` ids) plus ``VALUES_FLOOR`` for everything else;
- ``max_costly``: ``max(COSTLY_FLOOR, 2 x max_model_len)``: a chat message is an object
  and about four strings and renders to a few tokens at least, so a conversation that
  fits the context stays well under it, with tools and schemas beside it (``logit_bias``
  holds at most 300 entries).

Past either, the body is refused with 413 naming the limit and the flags that raise it,
before a single value is parsed; what passes parses in tens of milliseconds at most
(``tests/server/test_json_budget.py`` prints the figures). The counts overshoot only for
invalid JSON, which the parser would refuse anyway.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pagewarden.server.errors import APIError

#: Values allowed beyond the token ids: sampling fields, messages, tools, schemas.
VALUES_FLOOR = 65536
#: Arrays, objects, strings, floats and booleans allowed whatever ``max_model_len`` is.
COSTLY_FLOOR = 32768
#: Bodies shorter than this are not scanned: they hold at most a few thousand values.
SCAN_MIN_BYTES = 16 * 1024
#: Bytes scanned between two turns of the event loop (well under a millisecond idle).
PIECE_BYTES = 1 << 18


@dataclass(frozen=True)
class JsonShape:
    """Upper bounds on what parsing a body builds (exact for valid JSON's strings)."""

    values: int  # values and keys, the top level included
    costly: int  # arrays, objects, strings (keys included), floats and booleans


class _ShapeCounter:
    """``JsonShape`` of a body fed in pieces that never split an escape (``_pieces``)."""

    def __init__(self, max_strings: int | None = None) -> None:
        self.max_strings = max_strings  # past it, stop counting: the body is refused
        self.quotes = self.containers = self.separators = self.inexact = 0
        self.inside = 0  # 1 while the bytes fed so far end inside a string

    def feed(self, piece: bytes) -> None:
        if b"\\" in piece:
            piece = piece.replace(b"\\\\", b"").replace(b'\\"', b"")
        quotes = piece.count(b'"')
        self.quotes += quotes
        if self.max_strings is not None and self.strings > self.max_strings:
            return  # too many strings already: no need to split them apart
        parts = piece.split(b'"') if quotes else [piece]
        outside = b"".join(parts[self.inside :: 2])
        self.inside ^= quotes & 1
        self.containers += outside.count(b"[") + outside.count(b"{")
        self.separators += outside.count(b",") + outside.count(b":")
        # a fraction or exponent marks a float; true and false hold an e too
        self.inexact += outside.count(b".") + outside.count(b"e") + outside.count(b"E")

    @property
    def strings(self) -> int:
        return self.quotes // 2

    def shape(self) -> JsonShape:
        costly = self.containers + self.strings + self.inexact
        return JsonShape(self.containers + self.separators + 1, costly)


def _pieces(body: bytes, size: int):
    """Slices of ``body`` of about ``size`` bytes, each ending on a byte that is not a
    backslash, so that no escape (a backslash and the byte after it) is split."""
    start, n = 0, len(body)
    while start < n:
        end = min(n, start + size)
        while end < n and body[end - 1] == 0x5C:  # a backslash
            end += 1
        yield body[start:end]
        start = end


def json_shape(body: bytes, piece_bytes: int = PIECE_BYTES) -> JsonShape:
    """``body``'s shape from its raw bytes (module doc)."""
    counter = _ShapeCounter()
    for piece in _pieces(body, piece_bytes):
        counter.feed(piece)
    return counter.shape()


@dataclass(frozen=True)
class JsonBudget:
    """The most JSON values, and costly values, one request body may hold (module doc)."""

    max_values: int
    max_costly: int

    @classmethod
    def for_server(cls, max_model_len: int, max_prompts_per_request: int) -> JsonBudget:
        return cls(
            max_values=max_prompts_per_request * max_model_len + VALUES_FLOOR,
            max_costly=max(COSTLY_FLOOR, 2 * max_model_len),
        )

    async def check(self, body: bytes) -> None:
        """413 when ``body`` holds more values than the budget allows. Scans
        ``PIECE_BYTES`` at a time and lets the event loop run between pieces; stops at
        the first piece past a limit."""
        if len(body) < SCAN_MIN_BYTES:
            return
        counter = _ShapeCounter(self.max_costly)
        for i, piece in enumerate(_pieces(body, PIECE_BYTES)):
            if i:
                await asyncio.sleep(0)
            counter.feed(piece)
            self._refuse_past(counter.shape())

    def _refuse_past(self, shape: JsonShape) -> None:
        if shape.costly > self.max_costly:
            raise APIError(
                413,
                f"the request body holds more than {self.max_costly} JSON arrays, objects, "
                f"strings, floats and booleans (2 x max_model_len, at least {COSTLY_FLOOR}); "
                "raise --max-model-len for more",
            )
        if shape.values > self.max_values:
            raise APIError(
                413,
                f"the request body holds more than {self.max_values} JSON values "
                f"(--max-prompts-per-request x --max-model-len token ids, and "
                f"{VALUES_FLOOR} more); raise either flag for more",
            )
