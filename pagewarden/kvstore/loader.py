"""Asynchronous tier loads: loader threads read requests' chains into host buffers.

The scheduler starts a ``LoadJob`` when it first looks at a waiting request; the request
then waits (it is not scheduled) while the rest of the batch keeps stepping. ``threads``
job threads run jobs side by side (one request's load does not queue behind another's);
each keeps up to ``window`` blocks of its chain in flight on a shared pool of
``fetchers`` threads (file reads, Redis round trips and the numpy checksum release the
GIL), and takes the results in chain order. Each fetch goes through ``load_one``
(``TierStore._load_one``), which verifies the entry against the requesting chain (model,
layout, hashes, token ids, checksum); a verified block is appended to ``job.blocks`` in
order. A job ends at the first miss (blocks fetched past it are dropped, uncounted),
when cancelled (the request was aborted) or when the loader made no progress for
``stall_timeout_s`` (a hung tier): the blocks verified so far are used, the rest of the
chain is computed. Nothing here touches the pool: the worker copies the blocks in and
checks them there once more before a step reads them.

Ownership: ``blocks`` is appended to by the job's thread only, and read by the engine
thread only after ``done`` is set or the job timed out (then the job is cancelled first
and the prefix read is a snapshot: a block appended later is ignored).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pagewarden.kvstore.format import BlockIdentity

logger = logging.getLogger("pagewarden.kvstore")


@dataclass(frozen=True)
class LoadedBlock:
    """A verified entry on its way into the pool."""

    payload: bytes
    checksum: int  # unsigned 64-bit block checksum
    tier: str
    key: str


LoadOne = Callable[[BlockIdentity], LoadedBlock | None]
#: Counts a block the job took (a verified block, or the miss that ends the chain) with
#: the seconds its fetch and verification took.
Account = Callable[[LoadedBlock | None, float], None]


class LoadJob:
    """The verified blocks of one request's chain, as the loader reads them."""

    def __init__(self, chain: Sequence[BlockIdentity], loader: TierLoader) -> None:
        self.chain = list(chain)
        self.blocks: list[LoadedBlock] = []
        self.done = threading.Event()
        self.cancelled = False
        self.timed_out = False
        self.issued = time.monotonic()
        self.finished: float | None = None  # time.monotonic() when the loader was done
        self._loader = loader

    def ready(self) -> bool:
        """True when the job finished, or stalled past the loader's timeout (then it is
        cancelled: what landed so far is all it gives)."""
        if self.done.is_set() or self.timed_out:
            return True
        if self._loader.stalled(self):
            self.cancelled = True
            self.timed_out = True
            self._loader.count_timeout()
            return True
        return False

    def result(self) -> list[LoadedBlock]:
        """The verified prefix of the chain (call once ``ready()``)."""
        return list(self.blocks)

    def cancel(self) -> None:
        """Stop loading (the request went away); the loader drops the job."""
        self.cancelled = True


class TierLoader:
    """Job threads that run ``LoadJob`` s side by side, each fetching a window of its
    chain in parallel (see the module docstring)."""

    def __init__(
        self,
        load_one: LoadOne,
        stall_timeout_s: float,
        account: Account | None = None,
        threads: int = 2,
        fetchers: int = 4,
        window: int = 8,
    ) -> None:
        if threads < 1 or fetchers < 1 or window < 1:
            raise ValueError("a tier loader needs at least one thread, fetcher and window slot")
        self.load_one = load_one
        self.account = account
        self.stall_timeout_s = stall_timeout_s
        self.window = window
        self.timeouts = 0  # jobs given up on: the loader made no progress in time
        self._jobs: queue.Queue[LoadJob | None] = queue.Queue()
        self._progress = time.monotonic()  # when the loader last finished a block or job
        self._wake = threading.Condition()
        self._fetch = ThreadPoolExecutor(fetchers, thread_name_prefix="kv-tier-fetch")
        self._threads = [
            threading.Thread(target=self._run, name=f"kv-tier-loader-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def start(self, chain: Sequence[BlockIdentity]) -> LoadJob:
        """Queue a load of ``chain``'s longest stored, verified prefix."""
        job = LoadJob(chain, self)
        self._jobs.put(job)
        return job

    def stalled(self, job: LoadJob) -> bool:
        """No block landed for ``stall_timeout_s`` since the job was issued."""
        since = max(job.issued, self._progress)
        return time.monotonic() - since > self.stall_timeout_s

    def count_timeout(self) -> None:
        self.timeouts += 1
        logger.warning(
            "KV tier: a load made no progress in %.1f s; the request computes its blocks",
            self.stall_timeout_s,
        )

    def wait(self, jobs: Sequence[LoadJob], timeout_s: float) -> None:
        """Block until one of ``jobs`` is done or ``timeout_s`` passed (an idle engine
        waits here rather than spinning)."""
        with self._wake:
            if not any(j.done.is_set() for j in jobs):
                self._wake.wait(timeout_s)

    def close(self) -> None:
        """Stop the threads after the jobs they are on (queued jobs are dropped)."""
        for _ in self._threads:
            self._jobs.put(None)
        self._fetch.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._progress = time.monotonic()
            try:
                self._load(job)
            except Exception:  # the loader must outlive any one bad job
                logger.exception("KV tier loader: a load failed; treated as a miss")
            finally:
                job.finished = time.monotonic()
                job.done.set()
                with self._wake:
                    self._wake.notify_all()

    def _timed(self, ident: BlockIdentity) -> tuple[LoadedBlock | None, float]:
        start = time.perf_counter()
        block = self.load_one(ident)
        return block, time.perf_counter() - start

    def _load(self, job: LoadJob) -> None:
        """Keep up to ``window`` fetches of ``job``'s chain in flight; take them in order."""
        chain = job.chain
        inflight: deque[Future[tuple[LoadedBlock | None, float]]] = deque()
        nxt = 0
        try:
            while not job.cancelled:
                while nxt < len(chain) and len(inflight) < self.window:
                    inflight.append(self._fetch.submit(self._timed, chain[nxt]))
                    nxt += 1
                if not inflight:
                    return
                block, seconds = inflight.popleft().result()
                self._progress = time.monotonic()
                if job.cancelled:
                    return
                if self.account is not None:
                    self.account(block, seconds)
                if block is None:
                    return
                job.blocks.append(block)
        finally:
            for fut in inflight:  # past the first miss, or the job went away
                fut.cancel()
