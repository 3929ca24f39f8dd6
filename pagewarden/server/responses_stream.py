"""Streaming ``/v1/responses``: the chat path's deltas as the Responses API's events.

The chat path shapes a growing output into deltas (``tools.StreamShaper``: content
pieces, a tool call's head with its name, then its arguments as they are generated);
``OutputStream`` turns them into output items, one open at a time, in output order::

    message        output_item.added, content_part.added,
                   output_text.delta ..., output_text.done, content_part.done,
                   output_item.done
    function_call  output_item.added (call_id, name, arguments ""),
                   function_call_arguments.delta ..., function_call_arguments.done,
                   output_item.done

An item is closed when the next one opens or the output ends; the items closed are the
response's ``output``, so the ``response.completed`` body repeats exactly what was
streamed (same ids, same text), as the openai client's stream helper checks.
"""

from __future__ import annotations

import json
import uuid
from typing import Any


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    """An assistant message output item holding ``text``."""
    return {
        "type": "message",
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def function_call_item(
    name: str,
    arguments: str,
    call_id: str | None = None,
    status: str = "completed",
    item_id: str | None = None,
) -> dict:
    """A function call output item."""
    return {
        "type": "function_call",
        "id": item_id or f"fc_{uuid.uuid4().hex}",
        "call_id": call_id or f"call_{uuid.uuid4().hex[:24]}",
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class EventWriter:
    """Server-sent events with the stream's running ``sequence_number``."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


class OutputStream:
    """The output items of one streamed response (see the module docstring).

    ``items`` holds the closed items in output order; the open one (if any) is at output
    index ``len(items)``, with ``acc`` its text or arguments so far.
    """

    def __init__(self, ev: EventWriter) -> None:
        self.ev = ev
        self.items: list[dict] = []
        self.open: dict | None = None
        self.acc = ""

    @property
    def _index(self) -> int:
        return len(self.items)

    def feed(self, deltas: list[dict]) -> list[str]:
        """Events for chat ``delta`` dicts (``content`` and ``tool_calls`` pieces)."""
        out: list[str] = []
        for delta in deltas:
            if delta.get("content"):
                out += self.text(delta["content"])
            for call in delta.get("tool_calls", ()):
                fn = call.get("function", {})
                if fn.get("name") is not None:
                    out += self.start_call(call["id"], fn["name"])
                if fn.get("arguments"):
                    out += self.arguments(fn["arguments"])
        return out

    def start_message(self) -> list[str]:
        """Close the open item and open an empty message."""
        out = self.close()
        item = message_item("", "in_progress")
        item["content"] = []
        self.open, self.acc = item, ""
        part = {"type": "output_text", "text": "", "annotations": []}
        out.append(self.ev("response.output_item.added", output_index=self._index, item=item))
        out.append(self._part_event("response.content_part.added", part=part))
        return out

    def text(self, piece: str) -> list[str]:
        in_message = self.open is not None and self.open["type"] == "message"
        out = [] if in_message else self.start_message()
        self.acc += piece
        out.append(self._part_event("response.output_text.delta", delta=piece, logprobs=[]))
        return out

    def start_call(self, call_id: str, name: str) -> list[str]:
        """Close the open item and open a function call."""
        out = self.close()
        item = function_call_item(name, "", call_id, "in_progress")
        self.open, self.acc = item, ""
        out.append(self.ev("response.output_item.added", output_index=self._index, item=item))
        return out

    def arguments(self, piece: str) -> list[str]:
        assert self.open is not None and self.open["type"] == "function_call"
        self.acc += piece
        return [
            self.ev(
                "response.function_call_arguments.delta",
                item_id=self.open["id"],
                output_index=self._index,
                delta=piece,
            )
        ]

    def close(self) -> list[str]:
        """The open item's closing events (none if no item is open)."""
        item, index, ev = self.open, self._index, self.ev
        if item is None:
            return []
        if item["type"] == "message":
            done = message_item(self.acc, "completed", item["id"])
            out = [
                self._part_event("response.output_text.done", text=self.acc, logprobs=[]),
                self._part_event("response.content_part.done", part=done["content"][0]),
            ]
        else:
            done = function_call_item(
                item["name"], self.acc, item["call_id"], "completed", item["id"]
            )
            out = [
                ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=self.acc,
                )
            ]
        out.append(ev("response.output_item.done", output_index=index, item=done))
        self.items.append(done)
        self.open, self.acc = None, ""
        return out

    def _part_event(self, kind: str, **fields: Any) -> str:
        assert self.open is not None
        return self.ev(
            kind, item_id=self.open["id"], output_index=self._index, content_index=0, **fields
        )
