"""CPU threads of the engine: how many torch uses, and which cores they may run on.

Applied once, where the engine starts, before the model loads. ``cpu_threads=None``
keeps torch's default (one thread per physical core the process may use), which suits
both a shared 2-core box and a dedicated server. ``cpu_bind`` restricts every thread
of the process (the engine thread, torch's OpenMP pool, and threads started later,
which inherit it) to a set of cores given as a Linux cpu list, e.g. ``"0-3,8"``;
``None`` leaves the affinity alone. OpenMP's spin-waiting is switched off by the
``OMP_WAIT_POLICY=PASSIVE`` default the CLI sets before torch starts.

That default makes every parallel region wake the sleeping threads (a futex wake, tens
of microseconds in a VM), about as much as a one-token step's small GEMMs gain from a
second core. So where the GEMMs are torch's (OpenMP), a CPU step of at most
``serial_step_tokens`` tokens runs on one thread (``StepThreads``); larger steps use
them all. Where they are the bf16 kernel on the kernels' own pool (``kernels/cpu/pool``,
whose idle worker polls between kernels instead of sleeping), every step uses all
threads (``default_serial_step_tokens``). Measured: ``bench/step_threads.py``.
"""

from __future__ import annotations

import os

import torch

#: Steps of at most this many tokens run on one thread where the GEMMs use OpenMP
#: (bench/step_threads.py).
SERIAL_STEP_TOKENS = 2


def default_serial_step_tokens(dtype: torch.dtype, device: torch.device) -> int:
    """``serial_step_tokens`` where the user gave none: 0 where a model computing in
    ``dtype`` on ``device`` runs its GEMMs on the kernels' pool, else SERIAL_STEP_TOKENS."""
    from pagewarden.kernels.cpu import linear as cpu_linear
    from pagewarden.kernels.cpu import pool as cpu_pool

    on_pool = cpu_linear.pick_packing(dtype, device) == "tiles" and cpu_pool.load() is not None
    return 0 if on_pool else SERIAL_STEP_TOKENS


class StepThreads:
    """Sets torch's thread count for each step: one thread for a step of at most
    ``serial_tokens`` tokens, else the count in force when this was made."""

    def __init__(self, serial_tokens: int) -> None:
        self.serial_tokens = serial_tokens
        self.full = torch.get_num_threads()
        self._current = self.full

    def before_step(self, num_tokens: int) -> None:
        threads = 1 if num_tokens <= self.serial_tokens else self.full
        if threads != self._current:
            torch.set_num_threads(threads)
            self._current = threads


class CpuBindError(ValueError):
    """A ``cpu_bind`` core list does not parse or names no core this process may use."""


def parse_cpu_list(spec: str) -> list[int]:
    """Cores of a Linux cpu list such as ``"0-3,8"``, sorted; raises CpuBindError."""
    cores: set[int] = set()
    try:
        for part in spec.split(","):
            lo, dash, hi = part.strip().partition("-")
            first = int(lo)
            last = int(hi) if dash else first
            if first < 0 or last < first:
                raise ValueError(part)
            cores.update(range(first, last + 1))
    except ValueError:
        raise CpuBindError(
            f"cpu_bind {spec!r} is not a cpu list; give cores like '0-3' or '0,2,4-7'"
        ) from None
    return sorted(cores)


def apply_cpu_threads(cpu_threads: int | None, cpu_bind: str | None) -> None:
    """Bind this process's threads to `cpu_bind` cores and set torch's thread count."""
    if cpu_bind is not None:
        cores = parse_cpu_list(cpu_bind)
        allowed = os.sched_getaffinity(0)
        if not set(cores) <= allowed:
            raise CpuBindError(
                f"cpu_bind {cpu_bind!r} names cores outside this process's set {sorted(allowed)}"
            )
        for tid in os.listdir("/proc/self/task"):  # every thread that exists already
            try:
                os.sched_setaffinity(int(tid), cores)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        if cpu_threads is None:
            cpu_threads = len(cores)
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
