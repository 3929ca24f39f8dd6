"""The engine-core process: one ``EngineCore`` stepping in a process of its own.

The HTTP process (``server/``) never runs model code and never shares a GIL with the
step loop: it talks to this process through two one-way pipes (``core_client.py`` holds
the other ends and supervises the process).

Transport: ``multiprocessing`` pipes carrying pickled tuples, not ZeroMQ + msgpack.
There is exactly one peer on the same host, so ZeroMQ's routing, reconnection and
multi-peer sockets buy nothing; pickle carries our dataclasses (``SamplingParams``,
``RequestOutput``, ``EngineStats``, the tokenizer) without a second schema that msgpack
would need kept in step with them; and the pipes are in the standard library. Both sides
batch: one message carries every add/abort queued since the last send, and one message
carries every output of a step, so the framing cost is per step, not per token.

Messages (tuples, first item the kind)::

    client -> core   ("add", request_id, prompt_token_ids, params, prompt, cache_salt)
                     ("abort", request_id)
                     ("profile", name)                  switch the engine profile
                     ("stop",)
                     ("dashboard",)                     take a snapshot (engine/snapshot.py)
                     ("inject", kind)                   test only (faults/remote.py)
                     ("pause", seconds)                 test only: no steps for that long
    core -> client   ("ready", EngineInfo)              once, after the model loaded
                     ("step", outputs, stats, failed)   after every step (failed:
                                                        [(request_id, message)])
                     ("beat", stats, failed)            while idle, every HEARTBEAT_S
                     ("dashboard", EngineSnapshot)      between steps, once asked, at most
                                                        every snapshot.MIN_INTERVAL_S
                     ("fatal", message)                 before exiting on an error

Failure isolation: a request whose parameters would make a step raise is failed alone
(``finish_reason="error"``) rather than taking the engine down. At admission, a request
with sampling features (temperature, penalties, top-k/p, logprobs) is first run through
the sampler on one row of random logits; if that raises, only it fails. If a step raises
anyway, each request in flight is probed again; the ones that fail the probe are failed
alone and the loop goes on. A failure no probe explains, or two failed steps in a row,
is not attributable: the process reports it and exits, and the supervisor restarts it.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from pagewarden.engine.config import EngineConfig
from pagewarden.engine.snapshot import MIN_INTERVAL_S, take_snapshot
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.admission import AdmissionLimits

logger = logging.getLogger("pagewarden.engine.proc")

#: While idle, the core sends a heartbeat this often (seconds).
HEARTBEAT_S = 0.2
#: Requests reaching an idle core: it waits for the rest of their burst before its first
#: step, until no message came for GATHER_QUIET_S (BURST_QUIET_S once a second request
#: came), the burst's prompts fill a step's token budget, or GATHER_MAX_S passed (seconds).
GATHER_QUIET_S = 0.02
BURST_QUIET_S = 0.05
GATHER_MAX_S = 0.3
#: Requests reaching a busy core are held (its running requests go on decoding) until
#: no request came for BUSY_QUIET_S or the first held one waited BUSY_MAX_S (seconds),
#: then admitted together: one prefill step for the burst, not a small one per arrival.
BUSY_QUIET_S = 0.015
BUSY_MAX_S = 0.1
#: Where the opt-in step trace goes (a file path; unset: no trace): a line per step
#: ("step", start, seconds, outputs, first tokens, running, waiting), per arrival and
#: per idle gather ("gather", start, seconds, requests still held).
TRACE_PATH = os.environ.get("PAGEWARDEN_STEP_TRACE")


def release_due(now: float, first: float, last: float, busy: bool) -> bool:
    """Whether held requests (the first arrived at ``first``, the last at ``last``) are
    handed to the core now: at once when it is idle (the idle gather waits for the rest
    of the burst), else once the burst went quiet or its first request waited long enough.

    Every step that prefills newly admitted prompts stalls the streams already decoding
    for the whole step; a burst admitted over several steps stalls them several times,
    and those stalls are the inter-token latency tail (bench/serve.py)."""
    return not busy or now - last >= BUSY_QUIET_S or now - first >= BUSY_MAX_S


@dataclass(frozen=True)
class EngineInfo:
    """What the front end needs to know about the engine, sent once at start-up."""

    model_name: str
    tokenizer: object  # pagewarden.models.tokenizer.Tokenizer (picklable)
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int  # including the reserved block 0
    max_num_seqs: int
    max_num_batched_tokens: int
    limits: AdmissionLimits  # what the front end checks a request against before sending it


class _Inbox:
    """Applies the client's messages to the core from a receiver thread.

    ``EngineCore.add_request`` / ``abort_request`` only enqueue (they are thread-safe);
    the step loop applies them at the start of its next step.
    """

    def __init__(self, core, conn: Connection, probe) -> None:
        self.core, self.conn, self.probe = core, conn, probe
        self.wake = threading.Event()
        self.stop = False
        self._lock = threading.Lock()
        self._failed: list[tuple[str, str]] = []
        self.params: dict[str, tuple[list[int], SamplingParams]] = {}
        self.snapshot_wanted = False
        self.debug: list[tuple] = []  # "inject" and "pause" messages, applied between steps
        # Probed "add" messages not yet handed to the core, and when the first and the
        # last of them arrived (see ``release_due``).
        self.held: dict[str, tuple] = {}
        self.first_held = self.last_held = 0.0
        self.arrived = (0, 0)  # requests and prompt tokens that ever arrived
        self.trace = open(TRACE_PATH, "a", buffering=1) if TRACE_PATH else None  # noqa: SIM115

    def run(self) -> None:
        try:
            while not self.stop:
                for msg in self.conn.recv():
                    self._apply(msg)
                self.wake.set()
        except (EOFError, OSError):  # the client went away: stop serving
            pass
        self.stop = True
        self.wake.set()

    def _apply(self, msg: tuple) -> None:
        if msg[0] == "stop":
            self.stop = True
        elif msg[0] == "abort":
            with self._lock:
                held = self.held.pop(msg[1], None)
            if held is None:
                self.core.abort_request(msg[1])
        elif msg[0] == "dashboard":
            self.snapshot_wanted = True
        elif msg[0] in ("inject", "pause"):
            with self._lock:
                self.debug.append(msg)
        elif msg[0] == "profile":
            try:
                self.core.request_profile(msg[1])
            except ValueError as exc:  # ProfileError: the front end checks names first
                logger.error("profile switch refused: %s", exc)
        elif msg[0] == "add":
            _, rid, ids, params, prompt, salt = msg
            error = self.probe(ids, params)
            if error is not None:
                self.fail(rid, f"the request's parameters fail in the sampler: {error}")
                return
            now = time.monotonic()
            if self.trace is not None:
                self.trace.write(f"arrive {now:.4f}\n")
            with self._lock:
                if not self.held:
                    self.first_held = now
                self.last_held = now
                self.held[rid] = msg
                self.arrived = (self.arrived[0] + 1, self.arrived[1] + len(ids))

    def has_held(self) -> bool:
        return bool(self.held)

    def release(self, busy: bool) -> None:
        """Hand the held requests to the core when ``release_due`` says so (under the
        lock, so that an abort finds each request either held or in the core)."""
        from pagewarden.engine.core import RequestRejected

        with self._lock:
            if not self.held:
                return
            if not release_due(time.monotonic(), self.first_held, self.last_held, busy):
                return
            held, self.held = list(self.held.values()), {}
            for _, rid, ids, params, prompt, salt in held:
                try:
                    self.core.add_request(rid, ids, params, prompt=prompt, cache_salt=salt)
                except (RequestRejected, ValueError) as exc:
                    self._failed.append((rid, str(exc)))
                    continue
                self.params[rid] = (ids, params)

    def fail(self, rid: str, message: str) -> None:
        with self._lock:
            self._failed.append((rid, message))

    def take_failed(self) -> list[tuple[str, str]]:
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    def take_debug(self) -> list[tuple]:
        with self._lock:
            msgs, self.debug = self.debug, []
        return msgs

    def forget(self, rid: str) -> None:
        with self._lock:
            self.params.pop(rid, None)

    def in_flight(self) -> list[tuple[str, list[int], SamplingParams]]:
        with self._lock:
            return [(rid, ids, p) for rid, (ids, p) in self.params.items()]


def make_probe(vocab_size: int):
    """A function that runs one request's sampling parameters through the sampler on
    random logits and returns the exception text, or None when they sample fine."""
    import torch

    from pagewarden.worker.sampler import Sampler, SamplingRow

    sampler = Sampler(vocab_size, torch.Generator().manual_seed(0))

    def probe(ids: list[int], params: SamplingParams) -> str | None:
        plain = (
            params.greedy
            and params.logprobs is None
            and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0
            and params.repetition_penalty == 1.0
        )
        if plain:  # argmax only: nothing that depends on the parameters
            return None
        try:
            logits = torch.randn(1, vocab_size)  # (1, V)
            sampler(logits, [SamplingRow(params, ids[-64:], [], params.seed, 0)])
        except Exception as exc:  # noqa: BLE001 - any failure is this request's
            return f"{type(exc).__name__}: {exc}"
        return None

    return probe


def _engine_info(core) -> EngineInfo:
    return EngineInfo(
        model_name=core.loaded.name,
        tokenizer=core.tokenizer,
        vocab_size=core.loaded.config.vocab_size,
        max_model_len=core.max_model_len,
        block_size=core.config.block_size,
        num_blocks=core.kv_store.shape.num_blocks,
        max_num_seqs=core.config.max_num_seqs,
        max_num_batched_tokens=core.config.max_num_batched_tokens,
        limits=core.scheduler.admission_limits(vocab_size=core.loaded.config.vocab_size),
    )


def _fail_outputs(core, inbox: _Inbox, failed: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Drop failed requests from the core (their blocks are freed at the next step)."""
    for rid, _ in failed:
        core.outputs.abort(rid, reason="error")
        core.abort_request(rid)
        inbox.forget(rid)
    return failed


def _isolate(core, inbox: _Inbox, exc: BaseException) -> list[tuple[str, str]]:
    """After a failed step: the in-flight requests whose parameters fail the probe."""
    culprits = []
    for rid, ids, params in inbox.in_flight():
        error = inbox.probe(ids, params)
        if error is not None:
            culprits.append((rid, f"the request failed a step: {error}"))
    if not culprits:
        raise RuntimeError(f"a step failed and no request explains it: {exc!r}") from exc
    logger.warning("step failed (%r); failing %d request(s) alone", exc, len(culprits))
    return culprits


class _Dashboard:
    """Snapshots and test-only fault injection, served between steps."""

    def __init__(self) -> None:
        self.faults = None  # faults.remote.RemoteFaults, made at the first debug message
        self.last_snapshot = 0.0
        self.paused_until = 0.0

    def paused(self) -> bool:
        return time.monotonic() < self.paused_until

    def serve(self, core, inbox: _Inbox, out: Connection) -> None:
        for msg in inbox.take_debug():
            if self.faults is None:  # fault machinery is loaded only when a test asks
                from pagewarden.faults.remote import RemoteFaults

                self.faults = RemoteFaults(core)
            if msg[0] == "inject":
                self.faults.apply(msg[1])
            elif self.faults.may_pause(msg[1]):
                self.paused_until = time.monotonic() + msg[1]
        now = time.monotonic()
        if inbox.snapshot_wanted and now - self.last_snapshot >= MIN_INTERVAL_S:
            inbox.snapshot_wanted = False
            self.last_snapshot = now
            out.send(("dashboard", take_snapshot(core)))


def _gather_burst(inbox: _Inbox, since: tuple[int, int], budget: int) -> None:
    """Wait while more requests of a burst are still arriving at an idle core.

    A client that opens many streams at once reaches the core over tens to hundreds of
    milliseconds (the HTTP process parses and tokenizes each request; a client opening
    new connections leaves gaps of 40 ms). Stepping on the first ones spreads the
    burst's prompts over more prefill steps, and every prefill step stalls the streams
    that started before it: those stalls are the inter-token latency tail
    (bench/serve.py). A lone request waits GATHER_QUIET_S; once a second came, the gather
    waits for BURST_QUIET_S of quiet, and ends as soon as the prompts that came since
    ``since`` (the inbox's ``arrived`` counts when the core went idle) fill ``budget``
    tokens: the first step can take no more."""
    deadline = time.monotonic() + GATHER_MAX_S
    while not inbox.stop:
        inbox.wake.clear()
        count, tokens = (now - then for now, then in zip(inbox.arrived, since, strict=True))
        if tokens >= budget:
            return
        left = deadline - time.monotonic()
        quiet = GATHER_QUIET_S if count < 2 else BURST_QUIET_S
        if left <= 0 or not inbox.wake.wait(min(quiet, left)):
            return


def _trace_line(core, t0: float, outputs) -> str:
    """One step of the opt-in step trace (PAGEWARDEN_STEP_TRACE=file): start, seconds,
    tokens streamed, first tokens, running, waiting."""
    firsts = sum(len(o.outputs[0].token_ids) == 1 for o in outputs if o.outputs)
    sched = core.scheduler
    dt = time.monotonic() - t0
    return f"step {t0:.4f} {dt:.4f} {len(outputs)} {firsts} {len(sched.running)} {len(sched.waiting)}\n"


def _loop(core, inbox: _Inbox, out: Connection) -> None:
    last_send = 0.0
    failed_steps = 0
    dashboard = _Dashboard()
    idle, idle_since = True, inbox.arrived
    trace = inbox.trace
    while not inbox.stop:
        dashboard.serve(core, inbox, out)
        inbox.release(busy=core.has_unfinished())
        failed = _fail_outputs(core, inbox, inbox.take_failed())
        if not core.has_unfinished() or dashboard.paused():
            now = time.monotonic()
            if failed or now - last_send >= HEARTBEAT_S:
                out.send(("beat", core.stats(), failed))
                last_send = now
            if not idle:
                idle, idle_since = True, inbox.arrived
            inbox.wake.wait(HEARTBEAT_S)
            inbox.wake.clear()
            continue
        if idle:
            g0 = time.monotonic()
            _gather_burst(inbox, idle_since, core.scheduler.max_num_batched_tokens)
            if trace is not None:
                trace.write(f"gather {g0:.4f} {time.monotonic() - g0:.4f} {len(inbox.held)}\n")
            inbox.release(busy=False)
            idle = False
        try:
            t0 = time.monotonic()
            outputs = core.step()
            if trace is not None:
                trace.write(_trace_line(core, t0, outputs))
            failed_steps = 0
        except Exception as exc:  # noqa: BLE001 - isolated below, or re-raised
            if core.recorder is not None:
                core.recorder.dump(f"engine step raised {exc!r}")
            failed_steps += 1
            if failed_steps > 1:
                raise
            failed += _fail_outputs(core, inbox, _isolate(core, inbox, exc))
            outputs = []
        for o in outputs:
            if o.finished:
                inbox.forget(o.request_id)
        out.send(("step", outputs, core.stats(), failed))
        last_send = time.monotonic()


def run_engine_core(config: EngineConfig, inbox_conn: Connection, out_conn: Connection) -> None:
    """Entry point of the engine-core process: load, report ready, step until told to stop.

    SIGINT is ignored: a Ctrl-C in the terminal reaches the whole process group, and the
    server, not the signal, decides when the core stops (a "stop" message, or the pipe
    closing when the server process is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        from pagewarden.engine.core import EngineCore

        core = EngineCore(config)
        core.claim_ownership()
        inbox = _Inbox(core, inbox_conn, make_probe(core.loaded.config.vocab_size))
        # The start-up heap (model, tokenizer) lives as long as the process: freeze it so
        # that no later collection walks it.
        gc.collect()
        gc.freeze()
        out_conn.send(("ready", _engine_info(core)))
        threading.Thread(target=inbox.run, name="pagewarden-inbox", daemon=True).start()
        _loop(core, inbox, out_conn)
        # Apply the aborts that came with the stop so every block is freed.
        if core.has_unfinished():
            core.step()
        if core.kv_events is not None:
            core.kv_events.close()
        core.shutdown()  # the pool's cached prefix blocks and the queue to the KV tiers
        if core.recorder is not None:
            core.recorder.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the supervisor, then exit
        message = f"{type(exc).__name__}: {exc}"
        logger.error("engine core failed: %s\n%s", message, traceback.format_exc())
        try:
            out_conn.send(("fatal", message))
        except (OSError, ValueError):
            pass
        raise SystemExit(1) from None
