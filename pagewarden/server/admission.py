"""Admission control at the front door: shed a spike before reading a byte of its bodies.

``AdmissionGate`` is a raw ASGI layer in front of the FastAPI app. For a generation POST
it compares one counter (generation requests in flight: admitted by the gate and not yet
answered) with the current limit; past it, it answers 429 itself from pre-encoded bytes,
without routing, parsing or tokenizing, so a rejected request costs a few microseconds
of this process's CPU. Every other route passes through untouched.

A request under the limit takes its slot only once its whole body has arrived: the gate
reads the body first, within ``body_timeout_s`` (408 and the connection closed past it;
413 past ``max_body_bytes``), so a client trickling bodies on many connections holds no
slot. The slot is then taken if the limit and the key's share allow: each API key (the
``Authorization`` header) may hold at most ``max_inflight_per_key`` slots, by default a
fair share of the limit, ``ceil(limit / keys with requests in flight)`` (all of it for a
key alone), so one tenant's flood cannot take the slots of another.

``AdmissionController`` sets the limit:

- capacity: what the engine can hold at once, ``min(max_num_seqs, KV pool tokens /
  min(TYPICAL_REQUEST_TOKENS, max_model_len))``, from the ``EngineInfo`` the core sent at start-up;
- the limit starts at that capacity (a client running as many requests at once as the
  engine batches is served, not shed: a benchmark at concurrency 32 must see no 429) and
  moves AIMD-style in windows where the limit binds (the gate was full), on two signals
  of what admitted requests live through:

  - the time they wait for their first token: over ``target_queue_s`` (default 2 s,
    about what a CPU engine needs to prefill a full batch);
  - the time between their tokens (the window's mean time per token, which is what a
    stream's length multiplies): over ``target_itl_ratio`` (default 2) times the
    lowest window mean seen, which is what a token costs on a lightly loaded engine.
    A spike that fills the batch slows every admitted stream by the batch's size (a
    step at batch 180 takes several times one at batch 4); this keeps admitted
    requests near their unloaded speed and turns the rest away instead of letting
    every stream crawl. The baseline rises only in light windows (recovery, below).

  Either over its target cuts the limit to three quarters of the window's peak in
  flight (a limit above that peak did not slow anyone); both under raise it by one. A
  window where the limit did not bind never cuts it: a slow first token there comes
  from a burst the engine is already holding (32 prompts arriving at once take about
  2.5 s to prefill on 2 cores), and a lower limit would only turn away requests the
  engine serves;
- onset: the gate admits at most ``burst`` (32) requests beyond ``proven``, the most
  requests that produced tokens at once in a window within both targets
  (``admit_limit``). The limit starts at capacity, and a spike's first instant would
  otherwise fill the whole batch before any window could see it: 1,024 connections
  filled 90 slots at once, and every request admitted then took 10x its unloaded time
  while the limit fell to 2 above them. Requests not yet past their first token do not
  count as proof (the window's latencies do not come from them yet). A client at
  concurrency 32 (vLLM's serving benchmark) starts within the burst and, never turned
  away, never cuts the limit;
- recovery: a window that is light (at most half the limit in flight at its peak, idle
  included) halves the distance from the limit to capacity, and lets the ITL baseline
  rise to the window's mean time per token where that is higher (by at most half per
  window): what one client's burst taught the controller is forgotten within about
  ``RECOVERY_S`` of light load, so the next client starts at capacity. Windows roll on
  every gate call and engine report, so idle time counts too;
- ``fixed_limit`` pins it (``--max-inflight-requests``); ``enabled=False`` turns the gate
  off (``--no-admission-control``).

``retry_after_s()`` is the time the measured drain rate (answers per second over the
last window) needs to free a slot for the rejected client, times a uniform jitter in
[0.5, 1.5] so that rejected clients do not all come back at the same instant. The 429
carries it as ``Retry-After`` (whole seconds, at least 1) and ``retry-after-ms`` (which
the OpenAI SDKs read first).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

#: Default of ``target_queue_s`` (``--admission-target-queue-time``).
DEFAULT_TARGET_QUEUE_S = 2.0
#: Default of ``target_itl_ratio`` (``--admission-target-itl-ratio``).
DEFAULT_TARGET_ITL_RATIO = 2.0
#: Tokens a window needs before its mean time per token counts (as the baseline or
#: against it).
MIN_ITL_TOKENS = 8
#: Prompt + output tokens of a typical request, to turn the KV pool into a request count.
TYPICAL_REQUEST_TOKENS = 512
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
#: Seconds a generation request's whole body may take to arrive (``--body-timeout``).
BODY_TIMEOUT_S = 30.0
#: A light window moves the limit this share of the way back to capacity, and the
#: baseline up by at most this factor; from the minimum to capacity takes about
#: ``RECOVERY_S`` of light load with the default 0.5 s window (the gap halves 6 times).
RECOVERY_SHARE = 0.5
BASELINE_RISE = 1.5
RECOVERY_S = 3.0
#: Default of ``burst``: requests admitted beyond the most that ran within the latency
#: targets. A client at concurrency 32 (vLLM's serving benchmark) starts within it.
ONSET_BURST = 32


class AdmissionController:
    """The in-flight limit and the counters the gate and the engine report to.

    Invariant: ``0 <= in_flight``; ``min_limit <= limit <= capacity`` unless pinned.
    """

    def __init__(
        self,
        capacity: int,
        *,
        target_queue_s: float = DEFAULT_TARGET_QUEUE_S,
        target_itl_ratio: float = DEFAULT_TARGET_ITL_RATIO,
        fixed_limit: int | None = None,
        enabled: bool = True,
        min_limit: int = 2,
        window_s: float = 0.5,
        burst: int = ONSET_BURST,
        rng: random.Random | None = None,
    ) -> None:
        if capacity < 1 or target_queue_s <= 0 or (fixed_limit is not None and fixed_limit < 1):
            raise ValueError("admission: capacity, target and fixed limit must be positive")
        if target_itl_ratio <= 1:
            raise ValueError("admission: the inter-token latency ratio must be above 1")
        if burst < 1:
            raise ValueError("admission: the onset burst must be positive")
        self.capacity = capacity
        self.min_limit = min(min_limit, capacity)
        self.enabled = enabled
        self.fixed = fixed_limit is not None
        self.limit = fixed_limit if fixed_limit is not None else capacity
        self.target_queue_s = target_queue_s
        self.target_itl_ratio = target_itl_ratio
        self.base_itl_s: float | None = None  # lowest window mean time per token seen
        self.window_s = window_s
        self.burst = burst
        self.in_flight = 0
        # Admitted requests without a first token yet (an estimate: one answered before
        # its first token is dropped once fewer are in flight than waiting).
        self.waiting = 0
        # The most requests producing tokens at once in a window whose latency was within
        # both targets; the gate admits at most ``burst`` beyond it (``admit_limit``).
        self.proven = 0
        self.admit_limit = self.limit if self.fixed else min(self.limit, burst)
        self.rejected = 0
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._window_peak = 0  # most requests in flight at once in the window
        self._window_running = 0  # most of them past their first token at once
        self._window_max_queue = 0.0
        self._window_saturated = False
        self._window_token_time = 0.0  # seconds streams waited for the window's tokens
        self._window_tokens = 0
        self._done_in_window = 0
        self._drain_rate = 0.0  # answers per second, last full window

    # ---- the gate (event loop) -----------------------------------------------------
    def try_enter(self) -> bool:
        """Admit one generation request unless the limit is reached."""
        now = time.monotonic()
        if now - self._window_start >= self.window_s:
            with self._lock:
                self._roll_window(now)
        if self.enabled and self.in_flight >= self.admit_limit:
            self.note_rejected()
            return False
        self.in_flight += 1
        self.waiting += 1
        self._window_peak = max(self._window_peak, self.in_flight)
        return True

    def note_rejected(self) -> None:
        """Count a 429 sent at the limit (by the gate or by ``fast_reject``)."""
        self.rejected += 1
        self._window_saturated = True

    def leave(self) -> None:
        """An admitted request was answered (any outcome)."""
        with self._lock:
            self.in_flight -= 1
            self.waiting = min(self.waiting, self.in_flight)
            self._done_in_window += 1
            self._roll_window(time.monotonic())

    def refresh(self) -> None:
        """Roll the window if it is due (a metrics read calls this): an idle server's
        limit shows its recovery without waiting for the next request."""
        now = time.monotonic()
        if now - self._window_start >= self.window_s:
            with self._lock:
                self._roll_window(now)

    def retry_after_s(self) -> float:
        """Seconds until a slot is likely free, jittered (see the module docstring)."""
        ahead = max(1, self.in_flight - self.admit_limit + 1)
        rate = max(self._drain_rate, 1.0)
        return min(30.0, max(0.05, ahead / rate) * self._rng.uniform(0.5, 1.5))

    # ---- the engine's observer (reader thread) -------------------------------------
    def first_token(self, queue_time_s: float) -> None:
        with self._lock:
            self._window_max_queue = max(self._window_max_queue, queue_time_s)
            self.waiting = max(0, self.waiting - 1)
            self._note_running()
            if self.in_flight >= self.limit:
                self._window_saturated = True
            self._roll_window(time.monotonic())

    def inter_token(self, gap_s: float, tokens: int = 1) -> None:
        """An admitted stream received ``tokens`` more tokens ``gap_s`` after its last."""
        with self._lock:
            self._window_token_time += gap_s
            self._window_tokens += tokens
            self._note_running()
            self._roll_window(time.monotonic())

    def _note_running(self) -> None:
        """Requests producing tokens now: the batch the window's latencies come from."""
        self._window_running = max(self._window_running, self.in_flight - self.waiting)

    def finished(self) -> None:
        """The engine finished a request (the gate counts answers in ``leave``)."""

    def _roll_window(self, now: float) -> None:
        elapsed = now - self._window_start
        if elapsed < self.window_s:
            return
        self._drain_rate = self._done_in_window / elapsed
        light = not self._window_saturated and max(self._window_peak, self.in_flight) <= (
            self.limit // 2
        )
        itl = None
        if self._window_tokens >= MIN_ITL_TOKENS:
            itl = self._window_token_time / self._window_tokens
            if self.base_itl_s is None:
                self.base_itl_s = itl
            elif light:  # a light window's mean is what a token costs unloaded
                self.base_itl_s = min(itl, self.base_itl_s * BASELINE_RISE)
            else:
                self.base_itl_s = min(self.base_itl_s, itl)
        slow_itl = itl is not None and itl > self.target_itl_ratio * self.base_itl_s
        slow = self._window_max_queue > self.target_queue_s or slow_itl
        running = self._window_running
        if slow:
            self.proven = min(self.proven, math.floor(running * 0.75))
        elif itl is not None:
            self.proven = max(self.proven, running)
        if not self.fixed and self._window_saturated:  # cut only where the limit binds
            if slow:
                # From what was in flight: a limit above the window's peak did not slow it.
                ran = min(self.limit, self._window_peak)
                self.limit = max(self.min_limit, math.floor(ran * 0.75))
            else:
                self.limit = min(self.capacity, self.limit + 1)
        # Windows in which nothing rolled (no request, no token: the engine sat idle) are
        # light whenever what is in flight now is.
        quiet = int(elapsed / self.window_s) - 1 if self.window_s > 0 else 0
        quiet = min(64, quiet) if self.in_flight <= self.limit // 2 else 0
        if not self.fixed and not self._window_saturated and (light or quiet > 0):
            gap = (self.capacity - self.limit) * (1 - RECOVERY_SHARE) ** (light + quiet)
            self.limit = self.capacity - math.floor(gap)
        self._window_start = now
        self._window_peak = self.in_flight
        self._window_running = self.in_flight - self.waiting
        self.admit_limit = self.limit if self.fixed else min(self.limit, self.proven + self.burst)
        self._window_max_queue = 0.0
        self._window_saturated = False
        self._window_token_time = 0.0
        self._window_tokens = 0
        self._done_in_window = 0


def engine_capacity(max_num_seqs: int, num_blocks: int, block_size: int, max_model_len: int) -> int:
    """Requests the engine can hold at once: the batch limit or the KV pool, if smaller."""
    typical = min(TYPICAL_REQUEST_TOKENS, max_model_len)
    kv_requests = (num_blocks - 1) * block_size // typical
    return max(1, min(max_num_seqs, kv_requests))


class AdmissionGate:
    """Raw ASGI middleware: 429 without parsing when the controller says no; a slot taken
    only once the body is in, within the key's share (module doc).

    ``body`` is the pre-encoded 429 body (``fast_reject.py`` sends the same bytes)."""

    def __init__(
        self,
        app,
        controller: AdmissionController,
        *,
        max_body_bytes: int = 10 * 1024 * 1024,
        body_timeout_s: float = BODY_TIMEOUT_S,
        max_inflight_per_key: int | None = None,
    ) -> None:
        if body_timeout_s <= 0 or (max_inflight_per_key is not None and max_inflight_per_key < 1):
            raise ValueError("admission: body timeout and per-key limit must be positive")
        self.app = app
        self.controller = controller
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.max_inflight_per_key = max_inflight_per_key
        self.per_key: dict[bytes, int] = {}  # in-flight requests by Authorization header
        self.rejected_per_key = 0
        self.api: Any = None  # the application inside, where its builder sets it (api.py)
        self.body = _error_body(429, "the server is at capacity; retry after the Retry-After delay")

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in GENERATION_PATHS
        ):
            await self.app(scope, receive, send)
            return
        ctl = self.controller
        if ctl.enabled and ctl.in_flight >= ctl.admit_limit:  # shed before reading the body
            ctl.note_rejected()
            await self._reject(send, ctl.retry_after_s())
            return
        messages = await self._read_body(receive, send)
        if messages is None:
            return
        key = _header(scope, b"authorization")
        if ctl.enabled and not self._key_admits(key):
            if self.key_share(key) >= ctl.limit:  # a key alone: the limit itself binds
                ctl.note_rejected()
            else:  # counted, but one tenant's share says nothing of the engine's load
                ctl.rejected += 1
                self.rejected_per_key += 1
            await self._reject(send, ctl.retry_after_s())
            return
        if not ctl.try_enter():
            await self._reject(send, ctl.retry_after_s())
            return
        self.per_key[key] = self.per_key.get(key, 0) + 1
        try:
            await self.app(scope, _replay(messages, receive), send)
        finally:
            ctl.leave()
            left = self.per_key[key] - 1
            if left:
                self.per_key[key] = left
            else:
                del self.per_key[key]

    def key_share(self, key: bytes) -> int:
        """The most slots ``key`` may hold now."""
        if self.max_inflight_per_key is not None:
            return self.max_inflight_per_key
        active = len(self.per_key) + (key not in self.per_key)
        return max(1, math.ceil(self.controller.limit / active))

    def _key_admits(self, key: bytes) -> bool:
        return self.per_key.get(key, 0) < self.key_share(key)

    async def _read_body(self, receive, send) -> list[dict] | None:
        """The body's messages, or None once the client is gone or has been answered."""
        messages: list[dict] = []

        async def read() -> bool:
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return False
                messages.append(message)
                size += len(message.get("body", b""))
                if size > self.max_body_bytes:
                    await _send_error(
                        send,
                        413,
                        f"the request body exceeds the limit of {self.max_body_bytes} bytes",
                    )
                    return False
                if not message.get("more_body", False):
                    return True

        try:
            complete = await asyncio.wait_for(read(), self.body_timeout_s)
        except asyncio.TimeoutError:
            await _send_error(
                send,
                408,
                f"the request body did not arrive within {self.body_timeout_s:g} s",
                close=True,
            )
            return None
        return messages if complete else None

    async def _reject(self, send, retry_after: float) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 429,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(self.body)).encode()),
                    (b"retry-after", str(max(1, math.ceil(retry_after))).encode()),
                    (b"retry-after-ms", str(int(retry_after * 1000)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": self.body})


def _header(scope, name: bytes) -> bytes:
    for key, value in scope.get("headers") or ():
        if key == name:
            return value
    return b""


def _replay(messages: list[dict], receive) -> Callable[[], Awaitable[dict]]:
    """A ``receive`` that hands out the body already read, then the client's own."""
    pending = list(reversed(messages))

    async def replay() -> dict:
        return pending.pop() if pending else await receive()

    return replay


def _error_body(status: int, message: str) -> bytes:
    kind = {408: "RequestTimeout", 413: "RequestTooLarge", 429: "RateLimitError"}
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": kind.get(status, "APIError"),
                "param": None,
                "code": status,
            }
        }
    ).encode()


async def _send_error(send, status: int, message: str, close: bool = False) -> None:
    body = _error_body(status, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
