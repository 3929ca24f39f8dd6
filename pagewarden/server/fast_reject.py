"""The cheapest 429: answered by uvicorn's HTTP protocol as soon as the headers are parsed.

``AdmissionGate`` (admission.py) already rejects before the body is read, but by then
uvicorn has built the ASGI scope, a request cycle, an ``asyncio.Event`` and a task, and
the 429 goes out through two ASGI messages. Under a spike those are most of the CPU a
rejection costs. ``reject_fast_protocol(controller)`` returns a subclass of uvicorn's
httptools protocol that asks the same controller right after the request line and
headers are parsed; on "no" it writes pre-encoded 429 bytes to the socket, marks the
request answered so the body that follows is skipped by the parser callbacks, and keeps
the connection alive. Every other request takes uvicorn's normal path.

The same protocol gives request headers a deadline, which uvicorn does not: a connection
that has not finished sending a request's line and headers ``header_timeout_s`` after it
opened (or after that request's first byte) is closed. Without it, connections that send
half a header and stop stay open for ever, each holding a socket and a file descriptor.

It relies on uvicorn's ``HttpToolsProtocol`` internals (``on_headers_complete``,
``cycle.response_complete``, ``on_response_complete``); ``available()`` is False when
they are not there (no httptools, another uvicorn), and the server then uses uvicorn's
own protocol with the ASGI gate alone.
"""

from __future__ import annotations

import math

from pagewarden.server.admission import GENERATION_PATHS, AdmissionController, AdmissionGate

_PATHS = frozenset(p.encode() for p in GENERATION_PATHS)
#: Seconds a request's line and headers may take to arrive (``--header-timeout``).
HEADER_TIMEOUT_S = 10.0


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


def reject_fast_protocol(
    controller: AdmissionController,
    gate: AdmissionGate,
    header_timeout_s: float = HEADER_TIMEOUT_S,
) -> type:
    """A uvicorn ``http=`` protocol class that sheds with ``controller``'s limit and
    closes connections whose headers do not arrive within ``header_timeout_s``."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    body = gate.body

    class RejectFastProtocol(HttpToolsProtocol):
        _header_timer = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def on_message_begin(self) -> None:
            # A request pipelined behind a fast 429 must not inherit the keep-alive
            # timer that answering armed.
            self._unset_keepalive_if_required()
            self._arm_header_timer()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
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
