"""The ``AsyncEngine`` surface over a pool of Ray Serve replicas, with request migration.

The ingress runs the unchanged OpenAI routes of ``pagewarden.server`` on a
``RemoteEngine``: ``add_request`` sends a ``GenerateCall`` through a deployment handle
(the request router picks the replica) and returns a ``MigratingStream``, which yields
the same cumulative ``RequestOutput`` objects a local ``RequestStream`` does.

Migration: when the replica serving a request dies (its actor is lost, or its engine
core is down), the stream re-submits the request to another replica with the prompt
plus every token already streamed, asking only for the tokens still owed::

    attempt 0:  prompt               -> t0 t1 t2   (replica dies)
    attempt 1:  prompt t0 t1 t2      -> t3 t4 ...  (max_tokens - 3)
    client:     t0 t1 t2 t3 t4 ...                 (no duplicate, no gap)

A greedy request continues with exactly the tokens it would have had without the
failure (KV is a pure function of the tokens); its text too, unless the replica died
while holding back the first bytes of a multi-byte character split over tokens (the next
replica sees them as prompt, so that character can be missing from the text). An unseeded sampled request continues as a valid sample; a
seeded one too, but not with the tokens the seed would have given. Requests with
``n > 1``, presence/frequency penalties or stop strings are not migrated (their
continuation depends on state the new replica cannot rebuild from the tokens): they
fail with ``EngineDeadError`` as on a single engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagewarden.engine.async_engine import AdmissionObserver, EngineDeadError
from pagewarden.engine.core_proc import EngineInfo
from pagewarden.engine.outputs import CompletionOutput, RequestOutput
from pagewarden.metrics.stats import FrontendStats, FrontendStatsRecorder
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.admission import check_request
from pagewarden.serve.digest import ClusterView, GenerateCall

logger = logging.getLogger("pagewarden.serve")

#: Re-submissions of one request before the client gets the error.
MAX_MIGRATIONS = 3


def migratable(params: SamplingParams) -> bool:
    """Whether a request can continue on another replica from its tokens alone."""
    return (
        params.n == 1
        and not params.stop_strings
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
    )


def _rest(params: SamplingParams, num_done: int) -> SamplingParams:
    """The parameters of the rest of a request once ``num_done`` tokens are out."""
    max_tokens = None if params.max_tokens is None else params.max_tokens - num_done
    return dataclasses.replace(
        params, max_tokens=max_tokens, min_tokens=max(0, params.min_tokens - num_done)
    )


@dataclass(frozen=True)
class RemoteErrors:
    """How to read the exceptions a remote call raises (Ray's types stay in ``ray.py``).

    ``cause`` unwraps a remote task error to the replica's own exception; ``lost`` tells
    whether the replica went away; ``overloaded`` turns a load-shedding refusal into the
    ``AdmissionRejected`` the routes answer with 429 (None for anything else).
    """

    cause: Callable[[BaseException], BaseException]
    lost: Callable[[BaseException], bool]
    overloaded: Callable[[BaseException], BaseException | None]


class RemoteEngine:
    """What the server's routes need of an engine, served by Ray Serve replicas.

    ``handle`` is the engine deployment's handle; ``errors`` reads its exceptions;
    ``cluster()`` returns the latest ``ClusterView`` (summed stats and liveness from the
    replicas' digests).
    """

    def __init__(
        self,
        handle: Any,
        info: EngineInfo,
        errors: RemoteErrors,
        cluster: Callable[[], ClusterView],
    ) -> None:
        self.handle = handle
        self.info = info
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.errors = errors
        self.cluster = cluster
        self.observer: AdmissionObserver | None = None
        self.frontend_stats = FrontendStatsRecorder()
        self.migrations = 0

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> MigratingStream:
        """Check the request against the engine's limits and send it to a replica.

        Waits for the first output, so that refusals raise here as they do from
        ``AsyncEngine.add_request``: ``RequestRejected``, ``AdmissionRejected`` (a full
        replica, or Serve shedding load) or ``EngineDeadError``.
        """
        check_request(prompt_token_ids, params, self.info.limits)
        call = GenerateCall(request_id, list(prompt_token_ids), params, prompt, cache_salt)
        stream = MigratingStream(self, call)
        await stream.prime()
        return stream

    def abort_request(self, request_id: str) -> None:
        """Aborts go through ``MigratingStream.abort`` (the stream owns the remote call)."""

    def is_alive(self) -> bool:
        """True while at least one replica reported a live engine recently."""
        return self.cluster().alive

    def engine_stats(self):
        return self.cluster().engine_stats

    def stats(self) -> FrontendStats:
        gate = self.observer
        if gate is not None:
            gate.refresh()  # an idle gate's windows roll on reads too
        return self.frontend_stats.snapshot(
            engine_restarts=self.cluster().engine_restarts,
            gate_rejections=gate.rejected if gate is not None else 0,
            request_migrations=self.migrations,
            admission_limit=gate.limit if gate is not None else 0,
            admission_in_flight=gate.in_flight if gate is not None else 0,
            admission_itl_baseline_s=(gate.base_itl_s or 0.0) if gate is not None else 0.0,
        )


class MigratingStream:
    """Cumulative outputs of one request, carried across replicas (see the module doc).

    Invariant: every output yielded extends the previous one (token ids and text), so
    the routes' delta arithmetic sees one uninterrupted request.
    """

    def __init__(self, engine: RemoteEngine, call: GenerateCall) -> None:
        self.engine = engine
        self.call = call
        self.request_id = call.request_id
        self.finished = False
        self._response: Any = None  # the current replica's response generator
        self._last_token_at = 0.0
        self._outputs = self._run()
        self._first: RequestOutput | None = None

    async def prime(self) -> None:
        """Wait for the first output (kept for the first ``__anext__``)."""
        self._first = await self._next()

    def __aiter__(self) -> MigratingStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            out, self._first = self._first, None
            return out
        if self.finished:
            raise StopAsyncIteration
        return await self._next()

    async def _next(self) -> RequestOutput:
        try:
            out = await self._outputs.__anext__()
        except StopAsyncIteration:
            self.finished = True
            raise
        except BaseException:
            self.finished = True
            raise
        if out.finished:
            self.finished = True
        return out

    def abort(self) -> None:
        """Cancel the remote call (the replica aborts the request and frees its blocks)."""
        if not self.finished:
            self.finished = True
            if self._response is not None:
                self._response.cancel()

    async def _run(self) -> AsyncIterator[RequestOutput]:
        eng, call = self.engine, self.call
        arrival = time.monotonic()
        base: CompletionOutput | None = None  # what the client has from earlier replicas
        last: CompletionOutput | None = None
        num_cached = 0
        attempt = 0
        while True:
            sent = call
            if base is not None:
                sent = dataclasses.replace(
                    call,
                    request_id=f"{call.request_id}#m{attempt}",
                    prompt_token_ids=call.prompt_token_ids + base.token_ids,
                    params=_rest(call.params, len(base.token_ids)),
                    prompt=None,
                )
            self._response = eng.handle.options(stream=True).generate.remote(sent)
            try:
                async for out in self._response:
                    if base is None:
                        num_cached = out.num_cached_tokens
                    merged = [_extend(base, c) for c in out.outputs]
                    self._observe(arrival, last, merged[0] if merged else None)
                    last = merged[0] if merged else last
                    if out.finished:  # counted now: the consumer stops at a finished output
                        self._done(arrival, merged)
                    yield RequestOutput(
                        call.request_id,
                        call.prompt,
                        call.prompt_token_ids,
                        merged,
                        finished=out.finished,
                        num_cached_tokens=num_cached,
                        metrics=out.metrics,
                    )
                    if out.finished:
                        return
                raise EngineDeadError("the replica ended the stream before the request finished")
            except (asyncio.CancelledError, GeneratorExit):
                if last is None or last.finish_reason is None:  # aborted by the consumer
                    self._done(arrival, None, "abort")
                raise
            except BaseException as exc:
                exc = eng.errors.cause(exc)
                if not self._should_migrate(exc, attempt):
                    self._done(arrival, None)
                    raise self._client_error(exc) from None
                attempt += 1
                eng.migrations += 1
                base = last
                n = 0 if base is None else len(base.token_ids)
                logger.warning(
                    "request %s: replica lost after %d tokens; migrating (attempt %d): %s",
                    call.request_id,
                    n,
                    attempt,
                    type(exc).__name__,
                )

    def _client_error(self, exc: BaseException) -> BaseException:
        """What the routes should see: their own exception types where one fits."""
        shed = self.engine.errors.overloaded(exc)
        if shed is not None:
            return shed
        if self.engine.errors.lost(exc):
            return EngineDeadError(f"the replica serving the request died: {exc}")
        return exc

    def _should_migrate(self, exc: BaseException, attempt: int) -> bool:
        lost = isinstance(exc, EngineDeadError) or self.engine.errors.lost(exc)
        return (
            lost and not self.finished and attempt < MAX_MIGRATIONS and migratable(self.call.params)
        )

    def _observe(
        self, arrival: float, last: CompletionOutput | None, now_out: CompletionOutput | None
    ) -> None:
        """TTFT and inter-token latency at the ingress (what the client sees)."""
        if now_out is None or not now_out.token_ids:
            return
        had = 0 if last is None else len(last.token_ids)
        if len(now_out.token_ids) <= had:
            return
        now = time.monotonic()
        if had == 0:
            self.engine.frontend_stats.first_token(now - arrival, now - arrival)
            if self.engine.observer is not None:
                self.engine.observer.first_token(now - arrival)
        else:
            self.engine.frontend_stats.inter_token(now - self._last_token_at)
            if self.engine.observer is not None:
                gap, new = now - self._last_token_at, len(now_out.token_ids) - had
                self.engine.observer.inter_token(gap, new)
        self._last_token_at = now

    def _done(
        self, arrival: float, outputs: list[CompletionOutput] | None, failed: str = "error"
    ) -> None:
        reasons = [c.finish_reason or "abort" for c in outputs or []] or [failed]
        reason = next((r for r in ("error", "abort") if r in reasons), reasons[0])
        self.engine.frontend_stats.finished(reason, time.monotonic() - arrival)
        if self.engine.observer is not None:
            self.engine.observer.finished()


def _extend(base: CompletionOutput | None, c: CompletionOutput) -> CompletionOutput:
    """A continuation's output as the original request's cumulative output."""
    if base is None:
        return c
    logprobs = None
    if c.logprobs is not None:
        logprobs = list(base.logprobs or []) + list(c.logprobs)
    return CompletionOutput(
        base.index,
        base.text + c.text,
        base.token_ids + c.token_ids,
        c.finish_reason,
        c.stop_reason,
        logprobs,
    )
