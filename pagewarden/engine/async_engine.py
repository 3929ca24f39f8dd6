"""Async front end: streams the engine-core process's outputs to asyncio.

The engine core runs in its own process (``core_proc.py``), started and supervised by
``EngineCoreClient`` (``core_client.py``); this process never runs model code. The event
loop only queues messages for the core and reads what the client's reader thread
dispatched; ``is_alive()`` and ``engine_stats()`` read state that thread published, so
``/health`` and ``/metrics`` never wait on the engine.

Admission control bounds the requests that have not yet produced a first token
(``max_waiting_requests``) and their prompt tokens (``max_queued_tokens``); past either
bound ``add_request`` raises ``AdmissionRejected`` at once instead of queueing. The
server's front door (``server/admission.py``) sheds most of a spike before this point,
without parsing the body; these bounds are the exact check once the prompt is known.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core_client import EngineCoreClient
from pagewarden.engine.core_proc import EngineInfo
from pagewarden.engine.outputs import CompletionOutput, RequestOutput
from pagewarden.metrics.stats import FrontendStats, FrontendStatsRecorder
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.admission import check_request

logger = logging.getLogger("pagewarden.engine.async")


class AdmissionRejected(RuntimeError):
    """The waiting queue is full; retry after ``retry_after`` seconds (may be fractional)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine core is down (stopped, crashed or stalled); the request was not served."""


class AdmissionObserver(Protocol):
    """What the front door's admission controller wants to hear about requests."""

    rejected: int  # 429s it sent itself (counted in the admission_rejections metric)
    limit: int  # its current in-flight limit
    in_flight: int  # requests it admitted and that are not answered yet
    base_itl_s: float | None  # its unloaded time per token, once seen

    def refresh(self) -> None: ...

    def first_token(self, queue_time_s: float) -> None: ...

    def inter_token(self, gap_s: float, tokens: int = 1) -> None: ...

    def finished(self) -> None: ...


@dataclass
class _Tracker:
    """Per-request latency bookkeeping (the reader thread updates it under the lock)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_prompt_tokens: int
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    n: int = 1


def _deliver(tracker: _Tracker, item: RequestOutput | BaseException) -> None:
    """Hand an output (or the error ending the stream) to the request's event loop."""
    try:
        tracker.loop.call_soon_threadsafe(tracker.queue.put_nowait, item)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass


class RequestStream:
    """Async iterator over one request's cumulative outputs; ``abort()`` is idempotent."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (frees its KV blocks)."""
        if not self.finished:
            self.finished = True
            self.engine.abort_request(self.request_id)


class AsyncEngine:
    """The engine-core process seen from asyncio: add requests, stream their outputs."""

    def __init__(
        self,
        config: EngineConfig | None,
        *,
        max_waiting_requests: int | None = None,
        max_queued_tokens: int | None = None,
        stall_timeout_s: float = 60.0,
        observer: AdmissionObserver | None = None,
    ) -> None:
        self.max_waiting_requests = max_waiting_requests
        self.max_queued_tokens = max_queued_tokens
        self.observer = observer
        self.frontend_stats = FrontendStatsRecorder()
        self._lock = threading.Lock()
        self._trackers: dict[str, _Tracker] = {}
        self._num_waiting = 0  # admitted requests without a first token
        self._queued_tokens = 0
        self._engine_stats = None
        # The latest engine/snapshot.EngineSnapshot (None until the dashboard asks).
        self.snapshot = None
        self.client = EngineCoreClient(
            config if config is not None else EngineConfig(),
            self._on_message,
            self._on_lost,
            lambda: bool(self._trackers),
            stall_timeout_s=stall_timeout_s,
        )
        info = self.client.info
        assert info is not None
        self.info: EngineInfo = info
        self.tokenizer = info.tokenizer
        self.max_model_len: int = info.max_model_len
        deadline = time.monotonic() + 10.0  # the core's first heartbeat follows "ready"
        while self._engine_stats is None and time.monotonic() < deadline:
            time.sleep(0.01)

    # ---- event-loop side ---------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Check, admit and queue a request; raises before anything is queued.

        Raises ``RequestRejected`` (never runnable), ``AdmissionRejected`` (queue full),
        ``EngineDeadError`` (engine down) or ``ValueError`` (duplicate id).
        """
        if not self.is_alive():
            raise EngineDeadError("the engine is not running (restarting); retry shortly")
        # The one admission check, against the limits the core sent at start-up; the core
        # checks again on arrival, when the pool may have shrunk.
        check_request(prompt_token_ids, params, self.info.limits)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        n_prompt = len(prompt_token_ids)
        with self._lock:
            if request_id in self._trackers:
                raise ValueError(f"request id {request_id!r} is already running")
            self._admit(n_prompt)
            self._trackers[request_id] = _Tracker(
                loop, queue, n_prompt, time.monotonic(), n=params.n
            )
            self._num_waiting += 1
            self._queued_tokens += n_prompt
        self.client.send(("add", request_id, prompt_token_ids, params, prompt, cache_salt))
        return RequestStream(self, request_id, queue)

    def _admit(self, n_prompt: int) -> None:
        """Raise ``AdmissionRejected`` past the waiting bounds (caller holds the lock)."""
        if self.max_waiting_requests is not None and self._num_waiting >= self.max_waiting_requests:
            self.frontend_stats.admission_rejected()
            raise AdmissionRejected(
                f"the server has {self._num_waiting} requests waiting (limit "
                f"{self.max_waiting_requests}); retry later"
            )
        if (
            self.max_queued_tokens is not None
            and self._num_waiting > 0
            and self._queued_tokens + n_prompt > self.max_queued_tokens
        ):
            self.frontend_stats.admission_rejected()
            raise AdmissionRejected(
                f"the server has {self._queued_tokens} prompt tokens waiting (limit "
                f"{self.max_queued_tokens}); retry later"
            )

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until finished; cancelling or closing aborts."""
        stream = await self.add_request(request_id, prompt_token_ids, params, prompt, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort_request(self, request_id: str) -> None:
        """Abort a request from any thread; a finished or unknown id is a no-op."""
        self.client.send(("abort", request_id))

    def request_profile(self, name: str) -> None:
        """Ask the engine core to switch to profile ``name`` at its next step."""
        self.client.send(("profile", name))

    def is_alive(self) -> bool:
        """True while the engine core is up and making progress (from its heartbeat)."""
        return self.client.is_ready()

    def engine_stats(self):
        """The ``EngineStats`` the engine core sent with its latest step or heartbeat."""
        return self._engine_stats

    def request_snapshot(self) -> None:
        """Ask the core for a dashboard snapshot; it lands in ``snapshot`` (never blocks)."""
        self.client.send(("dashboard",))

    def send_debug(self, msg: tuple) -> None:
        """Send the core ``("inject", kind)`` or ``("pause", seconds)`` (tests only; the
        core refuses them unless ``faults/remote.py`` enables them)."""
        self.client.send(msg)

    def stats(self) -> FrontendStats:
        gate = self.observer
        if gate is not None:
            gate.refresh()  # an idle gate's windows roll on reads too
        return self.frontend_stats.snapshot(
            engine_restarts=self.client.restarts,
            gate_rejections=gate.rejected if gate is not None else 0,
            admission_limit=gate.limit if gate is not None else 0,
            admission_in_flight=gate.in_flight if gate is not None else 0,
            admission_itl_baseline_s=(gate.base_itl_s or 0.0) if gate is not None else 0.0,
        )

    @property
    def num_in_flight(self) -> int:
        return len(self._trackers)

    @property
    def num_waiting(self) -> int:
        """Admitted requests that have no first token yet."""
        return self._num_waiting

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core (in-flight requests fail with ``EngineDeadError``)."""
        self.client.shutdown(timeout)
        self._on_lost("the server is shutting down")

    # ---- reader / supervisor threads -----------------------------------------------
    def _on_message(self, msg: tuple) -> None:
        now = time.monotonic()
        if msg[0] == "dashboard":
            self.snapshot = msg[1]
            return
        if msg[0] == "step":
            _, outputs, stats, failed = msg
            self._engine_stats = stats
            for out in outputs:
                self._dispatch(out, now)
        else:  # "beat"
            _, stats, failed = msg
            self._engine_stats = stats
        for request_id, message in failed:
            self._fail_one(request_id, message, now)

    def _dispatch(self, out: RequestOutput, now: float) -> None:
        with self._lock:
            tracker = self._trackers.get(out.request_id)
            if tracker is None:
                return
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            if num_tokens > tracker.num_tokens:
                if tracker.first_token is None:
                    tracker.first_token = now
                    self._leave_waiting(tracker)
                    self.frontend_stats.first_token(now - tracker.arrival, now - tracker.arrival)
                    if self.observer is not None:
                        self.observer.first_token(now - tracker.arrival)
                else:
                    self.frontend_stats.inter_token(now - tracker.last_token)
                    if self.observer is not None:
                        gap, new = now - tracker.last_token, num_tokens - tracker.num_tokens
                        self.observer.inter_token(gap, new)
                tracker.last_token = now
                tracker.num_tokens = num_tokens
            if out.finished:
                self._finish(out.request_id, tracker, out, now)
        _deliver(tracker, out)

    def _finish(self, request_id: str, tracker: _Tracker, out: RequestOutput, now: float) -> None:
        """Forget a finished request and count it (caller holds the lock)."""
        del self._trackers[request_id]
        if tracker.first_token is None:
            self._leave_waiting(tracker)
        reasons = [c.finish_reason or "abort" for c in out.outputs]
        reason = next((r for r in ("error", "abort") if r in reasons), reasons[0])
        self.frontend_stats.finished(
            reason, now - tracker.arrival, tracker.num_prompt_tokens, tracker.num_tokens
        )
        if self.observer is not None:
            self.observer.finished()

    def _fail_one(self, request_id: str, message: str, now: float) -> None:
        """Finish one request with ``finish_reason="error"`` (the engine failed it alone)."""
        logger.warning("request %s failed: %s", request_id, message)
        with self._lock:
            tracker = self._trackers.get(request_id)
            if tracker is None:
                return
            out = RequestOutput(
                request_id,
                None,
                [],
                [CompletionOutput(i, "", [], "error", message) for i in range(tracker.n)],
                finished=True,
            )
            self._finish(request_id, tracker, out, now)
        _deliver(tracker, out)

    def _leave_waiting(self, tracker: _Tracker) -> None:
        self._num_waiting -= 1
        self._queued_tokens -= tracker.num_prompt_tokens

    def _on_lost(self, message: str) -> None:
        """The engine core is gone: fail every in-flight request with ``message``."""
        with self._lock:
            trackers = list(self._trackers.values())
            self._trackers.clear()
            self._num_waiting = 0
            self._queued_tokens = 0
        for tracker in trackers:
            self.frontend_stats.finished("error", time.monotonic() - tracker.arrival)
            if self.observer is not None:
                self.observer.finished()
            _deliver(tracker, EngineDeadError(message))
