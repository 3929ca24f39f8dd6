"""One key's slow bodies cannot take another key's slots (issue 35 item 2), real sockets.

Before admission waited for the body, one key holder trickling 260 connections kept
``admission_in_flight`` at 256 for 30 s while everyone else got 429. Here key A opens
300 connections that send their headers and a byte of body now and then, and key B's
completions must still succeed (the issue's bound: at least 95%).
"""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import pytest

from tests.server.test_api import MODEL, _engine, _Running


@pytest.fixture(scope="module")
def srv(tiny_llama_dir):
    s = _Running(_engine(tiny_llama_dir), api_key=["key-a", "key-b"], admission=True)
    yield s
    s.stop()


def _gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(rf"^pagewarden:{name}(\{{[^}}]*\}})? (\S+)$", text, re.M).group(2))


def test_one_key_trickling_300_slow_bodies_cannot_starve_another_key(srv):
    port = int(srv.url.rsplit(":", 1)[1])
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Authorization: Bearer key-a\r\nContent-Type: application/json\r\n"
        "Content-Length: 4000\r\n\r\n"
    ).encode()
    slow = []
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head + b'{"model": "')
        slow.append(s)
    stop = threading.Event()

    def trickle() -> None:  # one more byte on every connection each half second
        while not stop.wait(0.5):
            for s in slow:
                try:
                    s.sendall(b"x")
                except OSError:
                    pass

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    statuses, in_flight = [], []
    try:
        time.sleep(0.5)  # every slow connection has sent its headers
        with httpx.Client(
            base_url=srv.url, headers={"Authorization": "Bearer key-b"}, timeout=30
        ) as b:
            for _ in range(40):
                statuses.append(b.post("/v1/completions", json=body).status_code)
                in_flight.append(_gauge(srv.url, "admission_in_flight"))
    finally:
        stop.set()
        trickler.join(5)
        closed = 0
        for s in slow:  # still mid-body: none was answered, none timed out yet
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:  # open, nothing to read
                pass
            s.close()
    ok = statuses.count(200) / len(statuses)
    assert ok >= 0.95, statuses
    # The 300 trickling requests never held a slot: what is in flight is B's own.
    assert max(in_flight) <= 1, in_flight
    assert closed == 0  # the server had closed none of them: they were waiting, slot-less
