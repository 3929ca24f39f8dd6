"""The admission controller and the gate that answers 429 before parsing."""

from __future__ import annotations

import asyncio
import json
import random
import types

import pytest

from pagewarden.server import admission
from pagewarden.server.admission import AdmissionController, AdmissionGate, engine_capacity


def test_capacity_is_the_batch_or_the_kv_pool():
    assert engine_capacity(256, 1025, 16, 4096) == 32  # 1024 blocks * 16 / 512 tokens
    assert engine_capacity(8, 1025, 16, 4096) == 8
    assert engine_capacity(256, 65, 16, 256) == 4  # short context: 256 tokens a request
    assert engine_capacity(256, 2, 16, 4096) == 1


def test_limit_counts_in_flight_requests():
    ctl = AdmissionController(10, fixed_limit=2)
    assert ctl.try_enter() and ctl.try_enter()
    assert not ctl.try_enter() and ctl.rejected == 1
    ctl.leave()
    assert ctl.try_enter() and ctl.in_flight == 2


def test_limit_adapts_to_queue_time():
    ctl = AdmissionController(40, target_queue_s=0.5, window_s=0.0, burst=40)  # limit alone
    start = ctl.limit
    assert start == 40  # the engine's capacity
    for _ in range(32):  # a burst below the limit: slow first tokens move nothing
        assert ctl.try_enter()
    ctl.first_token(2.0)
    assert ctl.limit == 40
    for _ in range(8):  # the gate is full ...
        assert ctl.try_enter()
    ctl.first_token(2.0)  # ... and a window over the target: cut by a quarter
    assert ctl.limit == 30
    ctl.first_token(2.0)
    ctl.first_token(2.0)
    ctl.first_token(2.0)
    assert ctl.limit == 12
    ctl.first_token(2.0)
    assert ctl.limit == 9
    ctl.first_token(2.0)
    assert ctl.limit == 6
    for _ in range(34):  # answers drain to the limit: busy windows, the limit holds
        ctl.leave()
    assert ctl.limit == 6 and ctl.in_flight == 6
    assert not ctl.try_enter()  # saturated ...
    ctl.first_token(0.1)  # ... and under the target: one more
    assert ctl.limit == 7
    assert ctl.try_enter()  # full again: sustained slow first tokens cut to the floor
    for _ in range(100):
        ctl.first_token(10.0)
    assert ctl.limit == ctl.min_limit == 2
    for _ in range(7):  # the load leaves: light windows climb back to capacity
        ctl.leave()
    assert ctl.in_flight == 0
    climb = []
    while ctl.limit < ctl.capacity and len(climb) < 10:
        ctl.first_token(0.1)
        climb.append(ctl.limit)
    assert ctl.limit == 40 and len(climb) <= 7, climb  # halving the gap each window


def test_limit_adapts_to_inter_token_latency(monkeypatch):
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock.now)
    ctl = AdmissionController(40, target_itl_ratio=2.5, window_s=1.0, burst=40)

    def window(gap: float, n: int) -> None:
        """n token gaps of `gap` seconds in one window, then the window closes."""
        for _ in range(n):
            ctl.inter_token(gap)
        clock.now += 1.0
        ctl.inter_token(gap)  # rolls the window (and opens the next with this gap)

    window(0.02, 8)  # a light load: the baseline token gap, 20 ms
    assert ctl.base_itl_s == 0.02 and ctl.limit == 40
    for _ in range(21):  # over half the limit in flight: not a light window ...
        assert ctl.try_enter()
    window(0.2, 39)  # ... slow tokens where the limit does not bind move nothing
    assert ctl.limit == 40 and ctl.base_itl_s == 0.02
    for _ in range(19):
        assert ctl.try_enter()
    assert not ctl.try_enter()  # the gate is full ...
    window(0.06, 8)  # ... and tokens come 3x slower than the baseline: cut
    assert ctl.limit == 30
    assert not ctl.try_enter()
    window(0.5, 5)  # too few tokens for a mean: the queue-time rule alone (+1)
    assert ctl.limit == 31
    assert not ctl.try_enter()
    window(0.04, 8)  # 2x the baseline is within the target: +1
    assert ctl.limit == 32 and ctl.base_itl_s == 0.02
    assert not ctl.try_enter()
    ctl.inter_token(0.2, tokens=4)  # one gap that brought 4 tokens counts as 4 tokens
    window(0.1, 3)  # 0.6 s for 8 tokens: 75 ms a token, over 2.5 x 20 ms
    assert ctl.limit == 24


def test_a_flood_onset_admits_a_burst_beyond_what_ran_healthy(monkeypatch):
    """The limit starts at capacity, but the gate admits at most ``burst`` requests
    beyond the most that produced tokens at once within the latency targets: a spike's
    first instant no longer fills the whole batch before any window can see it."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock.now)
    ctl = AdmissionController(90, window_s=1.0, burst=32)

    def window(gap: float, n: int) -> None:
        for _ in range(n):
            ctl.inter_token(gap)
        clock.now += 1.0
        ctl.inter_token(gap)

    assert ctl.limit == 90 and ctl.admit_limit == 32
    for _ in range(12):  # twelve streams run at the unloaded speed
        assert ctl.try_enter()
        ctl.first_token(0.05)
    window(0.02, 24)
    assert ctl.proven == 12 and ctl.admit_limit == 44
    accepted = sum(ctl.try_enter() for _ in range(1000))  # the flood's first instant
    assert accepted == 32 and ctl.in_flight == 44 and ctl.limit == 90
    window(0.02, 24)  # the 32 have no first token: healthy tokens prove nothing of them
    assert ctl.proven == 12 and ctl.admit_limit == 44
    for _ in range(32):
        ctl.first_token(0.3)
    assert not ctl.try_enter()
    window(0.07, 44)  # 44 streams at 3.5x the baseline, the gate full: cut from the peak
    assert ctl.limit == 33 and ctl.proven == 12 and ctl.admit_limit == 33


def test_a_client_at_concurrency_32_is_never_refused(monkeypatch):
    """vLLM's serving benchmark at concurrency 32 from an idle server: slow windows
    where nobody was turned away cut nothing, and 32 fit in the onset burst."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock.now)
    ctl = AdmissionController(90, window_s=0.5)
    for _ in range(32):
        assert ctl.try_enter()
    for _ in range(200):  # answers come back and the client sends the next request
        for _ in range(32):
            ctl.first_token(3.0)  # a slow prefill of 32 prompts ...
            ctl.inter_token(0.1, 4)  # ... and tokens 5x slower than ...
        ctl.inter_token(0.02, 8)  # ... the unloaded speed
        clock.now += 0.25
        for _ in range(8):
            ctl.leave()
            assert ctl.try_enter()
    assert ctl.rejected == 0 and ctl.limit == 90 and ctl.admit_limit == 32


def test_disabled_or_pinned_limit_does_not_move():
    off = AdmissionController(4, enabled=False)
    assert all(off.try_enter() for _ in range(100))
    pinned = AdmissionController(40, fixed_limit=5, window_s=0.0)
    pinned.first_token(100.0)
    assert pinned.limit == 5


def test_retry_after_is_jittered_and_bounded():
    ctl = AdmissionController(4, fixed_limit=1, rng=random.Random(0))
    ctl.try_enter()
    values = [ctl.retry_after_s() for _ in range(200)]
    assert len({round(v, 3) for v in values}) > 100
    assert all(0.05 * 0.5 <= v <= 30.0 for v in values)
    assert max(values) / min(values) > 2  # spread over [0.5, 1.5] of the base


def test_gate_answers_429_without_reading_the_body():
    calls = []

    async def app(scope, receive, send):
        calls.append(scope["path"])
        if scope["method"] == "POST":  # the body the gate read comes to the app intact
            assert await receive() == {"type": "http.request", "body": b"{}", "more_body": False}

    ctl = AdmissionController(4, fixed_limit=1)
    gate = AdmissionGate(app, ctl)
    sent: list[dict] = []

    async def receive():
        # Under the limit the gate reads the body before taking a slot; at the limit never.
        assert ctl.in_flight < ctl.limit, "the gate must not read the body at the limit"
        assert not calls, "read by the gate before the app runs"
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(msg):
        sent.append(msg)

    async def run():
        scope = {"type": "http", "method": "POST", "path": "/v1/completions"}
        await gate(scope, receive, send)  # admitted: the app runs
        ctl.in_flight = 1  # one request still in flight
        await gate(scope, receive, send)  # at the limit: 429 from the gate
        await gate({**scope, "method": "GET", "path": "/health"}, receive, send)

    asyncio.run(run())
    assert calls == ["/v1/completions", "/health"]
    start, body = sent
    headers = dict(start["headers"])
    assert start["status"] == 429 and int(headers[b"retry-after"]) >= 1
    assert int(headers[b"retry-after-ms"]) > 0
    assert json.loads(body["body"])["error"]["code"] == 429


def test_fast_reject_protocol_answers_at_the_parser_and_keeps_the_connection():
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    from pagewarden.server.fast_reject import available, reject_fast_protocol

    assert available()
    seen = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    ctl = AdmissionController(4, fixed_limit=1)
    gate = AdmissionGate(app, ctl)
    config = uvicorn.Config(gate, http=reject_fast_protocol(ctl, gate), port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        with httpx.Client() as client:
            assert client.post(url + "/v1/completions", content=b"{}").status_code == 200
            ctl.in_flight = 1  # at the limit from now on
            r = client.post(url + "/v1/completions", content=b"x" * 100_000)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == 429 and "retry-after-ms" in r.headers
            assert client.get(url + "/health").status_code == 200  # same connection
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
                b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            data = b""
            while data.count(b"HTTP/1.1") < 2:
                data += s.recv(65536)
        assert data.startswith(b"HTTP/1.1 429") and b"HTTP/1.1 200" in data
        assert seen == ["/v1/completions", "/health", "/version"]
        assert ctl.rejected == 2
    finally:
        server.should_exit = True
        thread.join(10)


def test_an_idle_engine_forgets_a_burst_within_the_recovery_time(monkeypatch):
    """One client's abandoned burst cut the limit to the floor; nothing happens for
    RECOVERY_S; the next client's first request finds the limit back at capacity and a
    16-stream load under it is never refused."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock.now)
    ctl = AdmissionController(64, target_queue_s=2.0, window_s=0.5, burst=64)
    for _ in range(64):
        assert ctl.try_enter()
    for _ in range(60):  # a saturated, slow burst
        assert not ctl.try_enter()
        ctl.first_token(10.0)
        clock.now += 0.5
    assert ctl.limit == ctl.min_limit
    for _ in range(64):  # the client hangs up: its streams are aborted and answered
        ctl.leave()
    clock.now += admission.RECOVERY_S  # idle: no event at all
    accepted = sum(ctl.try_enter() for _ in range(16))
    assert accepted == 16 and ctl.limit >= 60


def test_the_itl_baseline_rises_back_after_light_windows(monkeypatch):
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock.now)
    ctl = AdmissionController(40, window_s=1.0)
    for gap in (0.005, 0.02, 0.02, 0.02, 0.02, 0.02):
        for _ in range(10):
            ctl.inter_token(gap)
        clock.now += 1.0
        ctl.inter_token(gap)
    # One unusually fast window set the baseline; light windows at 20 ms raise it back.
    assert ctl.base_itl_s == pytest.approx(0.02, rel=0.1)


def _drive(gate, scopes_and_bodies):
    """Run the gate on (scope, receive) pairs concurrently; returns the statuses sent."""
    statuses: list[int] = []

    async def one(scope, receive):
        async def send(msg):
            if msg["type"] == "http.response.start":
                statuses.append(msg["status"])

        await gate(scope, receive, send)

    async def run():
        await asyncio.gather(*(one(s, r) for s, r in scopes_and_bodies))

    asyncio.run(run())
    return statuses


def _scope(key: bytes = b"") -> dict:
    headers = [(b"authorization", key)] if key else []
    return {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}


def test_a_slow_body_holds_no_slot_and_times_out_with_408():
    held = []

    async def app(scope, receive, send):
        held.append(ctl.in_flight)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    ctl = AdmissionController(4, fixed_limit=1)
    gate = AdmissionGate(app, ctl, body_timeout_s=0.2)

    async def trickle():  # the first byte, then nothing
        if not hasattr(trickle, "sent"):
            trickle.sent = True
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.sleep(10)

    async def whole():
        await asyncio.sleep(0.05)  # arrives while the trickler is mid-body
        return {"type": "http.request", "body": b"{}", "more_body": False}

    statuses = _drive(gate, [(_scope(), trickle), (_scope(), whole)])
    # The complete request got the one slot; the trickler never held it and got 408.
    assert sorted(statuses) == [200, 408] and held == [1] and ctl.in_flight == 0


def test_a_body_over_the_limit_is_413_before_any_slot():
    async def app(scope, receive, send):
        raise AssertionError("never routed")

    ctl = AdmissionController(4, fixed_limit=2)
    gate = AdmissionGate(app, ctl, max_body_bytes=10)

    async def big():
        return {"type": "http.request", "body": b"x" * 11, "more_body": False}

    assert _drive(gate, [(_scope(), big)]) == [413] and ctl.in_flight == 0


def test_one_key_cannot_take_another_keys_share():
    release = asyncio.Event
    events: dict[str, object] = {}

    async def app(scope, receive, send):
        await events["go"].wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    ctl = AdmissionController(8, fixed_limit=8)
    gate = AdmissionGate(app, ctl)

    async def body():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def run():
        events["go"] = release()
        statuses: dict[bytes, list[int]] = {b"Bearer a": [], b"Bearer b": []}

        async def one(key):
            async def send(msg):
                if msg["type"] == "http.response.start":
                    statuses[key].append(msg["status"])

            await gate(_scope(key), body, send)

        async def until(cond) -> None:
            for _ in range(500):
                if cond():
                    return
                await asyncio.sleep(0.01)

        flood = [asyncio.create_task(one(b"Bearer a")) for _ in range(20)]
        await until(lambda: statuses[b"Bearer a"].count(429) == 12)
        # key a alone: it may use the whole limit
        assert gate.per_key == {b"Bearer a": 8} and statuses[b"Bearer a"].count(429) == 12
        events["go"].set()
        await asyncio.gather(*flood)
        events["go"] = release()
        first = [asyncio.create_task(one(b"Bearer b")) for _ in range(2)]
        await until(lambda: gate.per_key.get(b"Bearer b") == 2)
        second = [asyncio.create_task(one(b"Bearer a")) for _ in range(20)]
        await until(lambda: statuses[b"Bearer a"].count(429) == 28)
        # With b in flight, a's share is half the limit: b's requests were all admitted.
        assert gate.per_key == {b"Bearer b": 2, b"Bearer a": 4}
        events["go"].set()
        await asyncio.gather(*first, *second)
        assert statuses[b"Bearer b"] == [200, 200] and statuses[b"Bearer a"].count(429) == 28

    asyncio.run(run())


def test_half_sent_headers_are_closed_at_the_deadline():
    import socket
    import threading
    import time

    import uvicorn

    from pagewarden.server.fast_reject import reject_fast_protocol

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    ctl = AdmissionController(4)
    gate = AdmissionGate(app, ctl)
    proto = reject_fast_protocol(ctl, gate, header_timeout_s=0.5)
    server = uvicorn.Server(uvicorn.Config(gate, http=proto, port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        slow = []
        for i in range(40):
            s = socket.create_connection(("127.0.0.1", port))
            if i % 2:  # half send part of a request, half nothing at all
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            slow.append(s)
        with socket.create_connection(("127.0.0.1", port)) as ok:  # a whole one is served
            ok.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert ok.recv(1024).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)
        for s in slow:
            s.settimeout(2)
            assert s.recv(1024) == b""  # closed by the server
            s.close()
    finally:
        server.should_exit = True
        thread.join(10)


def test_fast_429s_arm_no_timer_and_idle_connections_still_close():
    """The header and keep-alive deadlines are swept once per tick for every connection,
    not armed per request (two ``call_later`` per 429 before): 200 pipelined 429s arm
    no timer; an idle connection is still closed after uvicorn's keep-alive time."""
    import socket
    import threading
    import time

    import uvicorn

    from pagewarden.server.fast_reject import reject_fast_protocol

    timers: list[float] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        loop = asyncio.get_running_loop()
        if not hasattr(loop, "_counted"):  # count every timer armed on the loop from now on
            plain = loop.call_later

            def counted(delay, *args, **kw):
                timers.append(delay)
                return plain(delay, *args, **kw)

            loop.call_later, loop._counted = counted, True
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    ctl = AdmissionController(4, fixed_limit=1)
    gate = AdmissionGate(app, ctl)
    proto = reject_fast_protocol(ctl, gate, header_timeout_s=8.0)  # sweeps once a second
    config = uvicorn.Config(
        gate, http=proto, port=0, log_level="warning", loop="asyncio", timeout_keep_alive=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(1024).startswith(b"HTTP/1.1 200")
            ctl.in_flight = 1  # at the limit from now on
            time.sleep(0.05)
            timers.clear()
            s.sendall(request * 200)
            data = b""
            while data.count(b"HTTP/1.1 429") < 200:
                data += s.recv(65536)
            armed_during_429s = [d for d in timers if d != 1.0]  # the sweep's own tick
            assert armed_during_429s == [], armed_during_429s
            s.settimeout(4)
            assert s.recv(1024) == b""  # idle after its last 429: closed in 1-2 s
        assert ctl.rejected == 200
    finally:
        server.should_exit = True
        thread.join(10)
