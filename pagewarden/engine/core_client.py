"""The front end's handle on the engine-core process, and its supervisor.

``EngineCoreClient`` starts ``core_proc.run_engine_core`` in a spawned process (never a
fork: the parent may hold OpenMP and tokenizer threads), sends it adds and aborts from a
sender thread (so the event loop never blocks on a full pipe), and receives its messages
on a reader thread that hands them to ``on_message``.

Supervision: a supervisor thread restarts the process when

- it exits or its pipe closes (a crash, an OOM kill, an unattributable step failure), or
- it stalls: no message (step output or idle heartbeat) for ``stall_timeout_s`` while
  ``has_work()`` says requests are in flight.

On either it calls ``on_lost(message)`` (the front end fails the in-flight requests with
that message), kills what is left of the process, counts a restart, and starts a fresh
one with backoff until it reports ready. ``is_ready()`` is False from the failure until
the new process is ready: it is the heartbeat ``/health`` reads, never a call into the
engine.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
from collections.abc import Callable

from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core_proc import EngineInfo, run_engine_core

logger = logging.getLogger("pagewarden.engine.supervisor")


class EngineStartError(RuntimeError):
    """The engine-core process could not load the model or start."""


class _Generation:
    """One engine-core process and its pipes; replaced whole on restart."""

    def __init__(self, config: EngineConfig, number: int) -> None:
        ctx = mp.get_context("spawn")
        self.number = number
        in_r, self.to_core = ctx.Pipe(duplex=False)
        self.from_core, out_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(config, in_r, out_w),
            name=f"pagewarden-engine-core-{number}",
            daemon=True,
        )
        self.proc.start()
        in_r.close()  # the child holds its own copies; ours would hide its death
        out_w.close()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = threading.Event()  # the pipe from the core reached EOF

    def send_loop(self) -> None:
        while True:
            msgs = [self.outbox.get()]
            while True:
                try:
                    msgs.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            if any(m is None for m in msgs):
                return
            try:
                self.to_core.send(msgs)
            except (OSError, ValueError):  # the core is gone; the supervisor restarts it
                return

    def kill(self) -> None:
        self.outbox.put(None)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        for conn in (self.to_core, self.from_core):
            try:
                conn.close()
            except OSError:
                pass


class EngineCoreClient:
    """Starts, feeds and supervises the engine-core process."""

    def __init__(
        self,
        config: EngineConfig,
        on_message: Callable[[tuple], None],
        on_lost: Callable[[str], None],
        has_work: Callable[[], bool],
        *,
        stall_timeout_s: float = 60.0,
        start_timeout_s: float = 600.0,
    ) -> None:
        self.config = config
        self.on_message, self.on_lost, self.has_work = on_message, on_lost, has_work
        self.stall_timeout_s = stall_timeout_s
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self.info: EngineInfo | None = None
        self.last_message = time.monotonic()
        self._ready = False
        self._stopping = False
        self._lock = threading.Lock()
        self._gen = self._start(0)
        if self.info is None:
            raise EngineStartError(self._start_error or "the engine core did not start")
        self._supervisor = threading.Thread(
            target=self._supervise, name="pagewarden-supervisor", daemon=True
        )
        self._supervisor.start()

    # ---- called from the event loop ----------------------------------------------
    def send(self, msg: tuple) -> None:
        """Queue a message for the core (never blocks)."""
        self._gen.outbox.put(msg)

    def is_ready(self) -> bool:
        """True while a core process is up and not stalled (the /health answer)."""
        if not self._ready or self._stopping:
            return False
        stalled = time.monotonic() - self.last_message > self.stall_timeout_s
        return not (stalled and self.has_work())

    @property
    def pid(self) -> int | None:
        """The engine-core process id (changes on restart)."""
        return self._gen.proc.pid

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait for it, then kill what is left."""
        self._stopping = True
        gen = self._gen
        gen.outbox.put(("stop",))
        gen.proc.join(timeout)
        gen.kill()

    # ---- process management --------------------------------------------------------
    def _start(self, number: int) -> _Generation:
        """Start a core process and wait for its ready message (or its failure)."""
        self._start_error: str | None = None
        gen = _Generation(self.config, number)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if gen.from_core.poll(0.1):
                try:
                    msg = gen.from_core.recv()
                except (EOFError, OSError):
                    break
                if msg[0] == "ready":
                    self.info = msg[1]
                    self.last_message = time.monotonic()
                    threading.Thread(target=gen.send_loop, daemon=True).start()
                    threading.Thread(target=self._read_loop, args=(gen,), daemon=True).start()
                    self._ready = True
                    return gen
                if msg[0] == "fatal":
                    self._start_error = f"the engine core failed to start: {msg[1]}"
                    break
            elif not gen.proc.is_alive():
                break
        self._start_error = self._start_error or (
            f"the engine core exited with code {gen.proc.exitcode} before it was ready"
        )
        gen.kill()
        return gen

    def _read_loop(self, gen: _Generation) -> None:
        try:
            while True:
                msg = gen.from_core.recv()
                self.last_message = time.monotonic()
                if msg[0] == "fatal":
                    gen.fatal = msg[1]  # type: ignore[attr-defined]
                    continue
                try:
                    self.on_message(msg)
                except Exception:  # noqa: BLE001 - a front-end bug must not look like a dead core
                    logger.exception("pagewarden: handling an engine message failed")
        except (EOFError, OSError):
            pass
        gen.closed.set()

    def _supervise(self) -> None:
        while not self._stopping:
            gen = self._gen
            if gen.closed.wait(0.1) or not gen.proc.is_alive():
                if self._stopping:
                    return
                why = getattr(gen, "fatal", None) or _exit_reason(gen.proc)
                self._restart(f"the engine core died ({why})")
            elif self.has_work() and time.monotonic() - self.last_message > self.stall_timeout_s:
                self._restart(
                    f"the engine core stalled (no step progress for {self.stall_timeout_s:g} s)"
                )

    def _restart(self, reason: str) -> None:
        self._ready = False
        self.restarts += 1
        logger.error("pagewarden: %s; failing in-flight requests and restarting it", reason)
        self._gen.kill()
        self.on_lost(f"{reason}; the request was not completed, retry it")
        backoff = 0.5
        while not self._stopping:
            gen = self._start(self._gen.number + 1)
            self._gen = gen
            if self._ready:
                logger.info("pagewarden: engine core restarted (restart %d)", self.restarts)
                return
            logger.error("pagewarden: %s; retrying in %.1f s", self._start_error, backoff)
            time.sleep(backoff)
            backoff = min(backoff * 2, 30.0)


def _exit_reason(proc) -> str:
    """How the core process ended, e.g. "killed by SIGKILL". Its pipe closes a moment
    before the process is reaped, so wait briefly for the exit code."""
    proc.join(2.0)
    code = proc.exitcode
    if code is None:
        return "its pipe closed but the process is still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
