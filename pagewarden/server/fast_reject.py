"""The cheapest 429: answered by uvicorn's HTTP protocol as soon as the headers are parsed.

``AdmissionGate`` (admission.py) already rejects before the body is read, but by then
uvicorn has built the ASGI scope, a request cycle, an ``asyncio.Event`` and a task, and
the 429 goes out through two ASGI messages. Under a spike those are most of the CPU a
rejection costs. ``reject_fast_protocol(controller)`` returns a subclass of uvicorn's
httptools protocol that asks the same controller right after the request line and
headers are parsed; on "no" it writes pre-encoded 429 bytes to the socket, marks the
request answered so the body that follows is skipped by the parser callbacks, and keeps
the connection alive. Every other request takes uvicorn's normal path.

It relies on uvicorn's ``HttpToolsProtocol`` internals (``on_headers_complete``,
``cycle.response_complete``, ``on_response_complete``); ``available()`` is False when
they are not there (no httptools, another uvicorn), and the server then uses uvicorn's
own protocol with the ASGI gate alone.
"""

from __future__ import annotations

import math

from pagewarden.server.admission import GENERATION_PATHS, AdmissionController, AdmissionGate

_PATHS = frozenset(p.encode() for p in GENERATION_PATHS)


class _NullEvent:
    def set(self) -> None:
        pass


class _Answered:
    """Stands in for uvicorn's request cycle once the 429 is written: the parser's body
    callbacks see ``response_complete`` and drop the body."""

    response_complete = True
    disconnected = False
    message_event = _NullEvent()


_ANSWERED = _Answered()


def available() -> bool:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return False
    return all(
        hasattr(HttpToolsProtocol, name)
        for name in ("on_headers_complete", "on_response_complete", "on_body")
    )


def _response(retry_after: float, body: bytes) -> bytes:
    head = (
        "HTTP/1.1 429 Too Many Requests\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"retry-after: {max(1, math.ceil(retry_after))}\r\n"
        f"retry-after-ms: {int(retry_after * 1000)}\r\n\r\n"
    )
    return head.encode() + body


def reject_fast_protocol(controller: AdmissionController, gate: AdmissionGate) -> type:
    """A uvicorn ``http=`` protocol class that sheds with ``controller``'s limit."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    body = gate.body

    class RejectFastProtocol(HttpToolsProtocol):
        def on_message_begin(self) -> None:
            # A request pipelined behind a fast 429 must not inherit the keep-alive
            # timer that answering armed.
            self._unset_keepalive_if_required()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            if (
                controller.enabled
                and controller.in_flight >= controller.limit
                and self.parser.get_method() == b"POST"
                and self.url.split(b"?", 1)[0] in _PATHS
                and self.parser.get_http_version() == "1.1"
                and self.parser.should_keep_alive()
                and (self.cycle is None or self.cycle.response_complete)
                and not self.parser.should_upgrade()
            ):
                controller.note_rejected()
                self.transport.write(_response(controller.retry_after_s(), body))
                self.cycle = _ANSWERED  # type: ignore[assignment]
                self.on_response_complete()
                return
            super().on_headers_complete()

    return RejectFastProtocol
