"""Async front end: runs ``EngineCore.step()`` in one daemon thread, streams to asyncio.

Ownership: the engine thread is the only thread that calls ``step()`` or ``stats()``,
so it is the only one touching scheduler and KV state. Event-loop code only enqueues
(``add_request`` / ``abort_request``, which the core makes thread-safe) and reads
snapshots the engine thread publishes.

Admission control bounds the requests that have not yet produced a first token
(``max_waiting_requests``) and their prompt tokens (``max_queued_tokens``); past either
bound ``add_request`` raises ``AdmissionRejected`` at once instead of queueing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagewarden.engine.config import EngineConfig
from pagewarden.engine.outputs import CompletionOutput, RequestOutput
from pagewarden.metrics.stats import FrontendStats, FrontendStatsRecorder
from pagewarden.sampling_params import SamplingParams

logger = logging.getLogger("pagewarden.engine.async")

#: The engine thread re-checks its stop flag and heartbeat this often when idle.
_IDLE_WAIT_S = 0.5


class AdmissionRejected(RuntimeError):
    """The waiting queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down or crashed); no request can be served."""


@dataclass
class _Tracker:
    """Per-request latency bookkeeping, owned by the engine thread after registration."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_prompt_tokens: int
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


def _snapshot(out: RequestOutput) -> RequestOutput:
    """Copy an output so the event loop never sees the engine thread mutate it."""
    outputs = [
        CompletionOutput(
            c.index,
            c.text,
            list(c.token_ids),
            c.finish_reason,
            c.stop_reason,
            list(c.logprobs) if c.logprobs is not None else None,
        )
        for c in out.outputs
    ]
    return RequestOutput(
        out.request_id,
        out.prompt,
        out.prompt_token_ids,
        outputs,
        out.finished,
        out.num_cached_tokens,
        dict(out.metrics),
    )


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
    """An ``EngineCore`` driven by a background thread, with asyncio streaming."""

    def __init__(
        self,
        config: EngineConfig | None,
        core=None,
        *,
        max_waiting_requests: int | None = None,
        max_queued_tokens: int | None = None,
        heartbeat_timeout_s: float = 60.0,
    ) -> None:
        if core is None:
            from pagewarden.engine.core import EngineCore

            core = EngineCore(config if config is not None else EngineConfig())
        self.core = core
        self.tokenizer = core.tokenizer
        self.max_model_len: int = core.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.max_queued_tokens = max_queued_tokens
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.frontend_stats = FrontendStatsRecorder()
        self._lock = threading.Lock()
        self._trackers: dict[str, _Tracker] = {}
        self._num_waiting = 0  # admitted requests without a first token
        self._queued_tokens = 0
        self._wake = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._heartbeat = time.monotonic()
        self._engine_stats = core.stats()
        self._thread = threading.Thread(target=self._run, name="pagewarden-engine", daemon=True)
        self._thread.start()

    # ---- event-loop side ---------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Validate, admit and enqueue a request; raises before anything is queued.

        Raises ``RequestRejected`` (never runnable), ``AdmissionRejected`` (queue full),
        ``EngineDeadError`` (engine stopped) or ``ValueError`` (duplicate id).
        """
        if not self.is_alive():
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        n_prompt = len(prompt_token_ids)
        with self._lock:
            if request_id in self._trackers:
                raise ValueError(f"request id {request_id!r} is already running")
            if (
                self.max_waiting_requests is not None
                and self._num_waiting >= self.max_waiting_requests
            ):
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
            self.core.add_request(
                request_id, prompt_token_ids, params, prompt=prompt, cache_salt=cache_salt
            )
            self._trackers[request_id] = _Tracker(loop, queue, n_prompt, time.monotonic())
            self._num_waiting += 1
            self._queued_tokens += n_prompt
        self._wake.set()
        return RequestStream(self, request_id, queue)

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
        self.core.abort_request(request_id)
        self._wake.set()

    def is_alive(self) -> bool:
        """True while the engine thread runs and its heartbeat is recent."""
        return (
            self._thread.is_alive()
            and not self._stopping
            and self._error is None
            and time.monotonic() - self._heartbeat < self.heartbeat_timeout_s
        )

    def engine_stats(self):
        """The ``EngineStats`` the engine thread published after its latest step."""
        return self._engine_stats

    def stats(self) -> FrontendStats:
        return self.frontend_stats.snapshot()

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._trackers)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every in-flight request, stop the engine thread and join it."""
        with self._lock:
            ids = list(self._trackers)
        for request_id in ids:
            self.core.abort_request(request_id)
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    # ---- engine thread -----------------------------------------------------------
    def _run(self) -> None:
        self.core.claim_ownership()
        try:
            while True:
                self._heartbeat = time.monotonic()
                if self._stopping:
                    self._step()  # apply the shutdown aborts so blocks are freed
                    break
                if not self.core.has_unfinished():
                    self._engine_stats = self.core.stats()
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self._step()
        except BaseException as exc:  # noqa: BLE001 - any crash must reach the clients
            logger.exception("engine thread crashed")
            self._error = exc
        finally:
            self._fail_all(
                EngineDeadError(
                    "the engine stopped"
                    if self._error is None
                    else f"the engine crashed: {self._error!r}"
                )
            )

    def _step(self) -> None:
        step_start = time.monotonic()
        outputs = self.core.step()
        now = time.monotonic()
        for out in outputs:
            self._dispatch(out, step_start, now)
        self._engine_stats = self.core.stats()

    def _dispatch(self, out: RequestOutput, step_start: float, now: float) -> None:
        with self._lock:
            tracker = self._trackers.get(out.request_id)
            if tracker is None:
                return
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            if num_tokens > tracker.num_tokens:
                if tracker.first_token is None:
                    tracker.first_token = now
                    self._leave_waiting(tracker)
                    # Queue time: until the start of the step that produced the first token.
                    self.frontend_stats.first_token(
                        now - tracker.arrival, step_start - tracker.arrival
                    )
                else:
                    self.frontend_stats.inter_token(now - tracker.last_token)
                tracker.last_token = now
                tracker.num_tokens = num_tokens
            if out.finished:
                del self._trackers[out.request_id]
                if tracker.first_token is None:
                    self._leave_waiting(tracker)
                reasons = [c.finish_reason or "abort" for c in out.outputs]
                reason = "abort" if "abort" in reasons else reasons[0]
                self.frontend_stats.finished(reason, now - tracker.arrival)
        tracker.loop.call_soon_threadsafe(tracker.queue.put_nowait, _snapshot(out))

    def _leave_waiting(self, tracker: _Tracker) -> None:
        self._num_waiting -= 1
        self._queued_tokens -= tracker.num_prompt_tokens

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            trackers = list(self._trackers.values())
            self._trackers.clear()
            self._num_waiting = 0
            self._queued_tokens = 0
        for tracker in trackers:
            try:
                tracker.loop.call_soon_threadsafe(tracker.queue.put_nowait, exc)
            except RuntimeError:  # that event loop is already closed
                pass
