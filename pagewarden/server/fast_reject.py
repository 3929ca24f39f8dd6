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
That deadline, and the keep-alive deadline after a fast 429, are checked by one sweep
per server (``_Deadlines``), not by a timer per request.

It relies on uvicorn's ``HttpToolsProtocol`` internals (``on_headers_complete``,
``cycle.response_complete``, what ``on_response_complete`` does, ``pipeline``); ``available()`` is False when
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
        for name in (
            "on_headers_complete",
            "on_response_complete",
            "on_body",
            "_unset_keepalive_if_required",
            "_start_asgi_task",
        )
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


class _Deadlines:
    """One periodic sweep for every connection of a server, in place of a timer armed
    and cancelled per request (each ``call_later`` and ``cancel`` pair costs a few
    microseconds, twice per 429: the header deadline and uvicorn's keep-alive timer).
    A connection holds the loop times by which its headers (``header_due``) and, idle
    after a fast 429, its next request (``idle_due``) must arrive; the sweep closes it
    past either, at most ``tick_s`` late."""

    def __init__(self, tick_s: float) -> None:
        self.tick_s = tick_s
        self.live: set = set()
        self._timer = None

    def add(self, conn) -> None:
        self.live.add(conn)
        if self._timer is None:
            self._timer = conn.loop.call_later(self.tick_s, self._sweep, conn.loop)

    def _sweep(self, loop) -> None:
        now = loop.time()
        for conn in list(self.live):
            header, idle = conn.header_due, conn.idle_due
            if (header is not None and now >= header) or (idle is not None and now >= idle):
                conn.header_due = conn.idle_due = None
                if not conn.transport.is_closing():
                    conn.transport.close()
        self._timer = loop.call_later(self.tick_s, self._sweep, loop) if self.live else None


def reject_fast_protocol(
    controller: AdmissionController,
    gate: AdmissionGate,
    header_timeout_s: float = HEADER_TIMEOUT_S,
) -> type:
    """A uvicorn ``http=`` protocol class that sheds with ``controller``'s limit and
    closes connections whose headers do not arrive within ``header_timeout_s``."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    body = gate.body
    deadlines = _Deadlines(tick_s=min(1.0, header_timeout_s / 4))

    class RejectFastProtocol(HttpToolsProtocol):
        header_due: float | None = None
        idle_due: float | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.header_due = self.loop.time() + header_timeout_s
            deadlines.add(self)

        def connection_lost(self, exc: Exception | None) -> None:
            deadlines.live.discard(self)
            super().connection_lost(exc)

        def _unset_keepalive_if_required(self) -> None:
            self.idle_due = None  # data arrived
            super()._unset_keepalive_if_required()

        def on_message_begin(self) -> None:
            # A request pipelined behind a fast 429 must not inherit its idle deadline.
            self._unset_keepalive_if_required()
            self.header_due = self.loop.time() + header_timeout_s
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self.header_due = None
            if (
                controller.enabled
                and controller.in_flight >= controller.admit_limit
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
                self._fast_response_complete()
                return
            super().on_headers_complete()

        def _fast_response_complete(self) -> None:
            """uvicorn's ``on_response_complete`` with the keep-alive deadline swept
            (``_Deadlines``) instead of a timer per response."""
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            self._unset_keepalive_if_required()
            self.flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            else:
                self.idle_due = self.loop.time() + self.timeout_keep_alive

    return RejectFastProtocol
