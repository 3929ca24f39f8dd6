"""The kernels' item pool (cpu_pool.cpp): every item runs exactly once, on a thread in
range, with the pool and with its OpenMP fallback; errors come back to the caller; a
second caller, a forked child and a zero spin all still get every item. And the kernels
give the same bits through the pool as through OpenMP."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from pagewarden.kernels.cpu import gemm as cpu_gemm
from pagewarden.kernels.cpu import linear as cpu_linear
from pagewarden.kernels.cpu import pool as cpu_pool
from pagewarden.worker.cpu_threads import SERIAL_STEP_TOKENS, default_serial_step_tokens

pool = cpu_pool.load()
needs_pool = pytest.mark.skipif(pool is None, reason="no C++ compiler: the kernels use OpenMP")


@pytest.fixture
def ext() -> Iterator[ModuleType]:
    """The pool extension with its test hook bound to the pool, two threads."""
    assert pool is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    pool.set_pool(pool.api())
    try:
        yield pool
    finally:
        pool.set_pool(None)
        torch.set_num_threads(threads)


def check_once(runs: torch.Tensor, thread_of: torch.Tensor, threads: int) -> None:
    assert runs.tolist() == [1] * runs.numel()
    assert thread_of.min().item() >= 0 and thread_of.max().item() < threads


@needs_pool
@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_every_item_runs_once(ext: ModuleType, n: int) -> None:
    runs, thread_of = ext.exercise(n, -1, 2000)
    check_once(runs, thread_of, 2)


@needs_pool
def test_the_worker_takes_items(ext: ModuleType) -> None:
    # Retried: a new worker may wait for a core (another process, a spinning OpenMP thread).
    seen: set[int] = set()
    for _ in range(50):
        runs, thread_of = ext.exercise(1000, -1, 2000)  # 2 ms of items
        check_once(runs, thread_of, 2)
        seen.update(thread_of.tolist())
        if seen == {0, 1}:
            break
    assert seen == {0, 1}


@needs_pool
def test_openmp_fallback_runs_every_item_once(ext: ModuleType) -> None:
    ext.set_pool(None)
    runs, thread_of = ext.exercise(500, -1, 1000)
    check_once(runs, thread_of, 2)


@needs_pool
def test_an_item_error_reaches_the_caller_and_the_pool_goes_on(ext: ModuleType) -> None:
    with pytest.raises(RuntimeError, match="item 37 raised on purpose"):
        ext.exercise(100, 37, 1000)
    runs, thread_of = ext.exercise(100, -1, 1000)
    check_once(runs, thread_of, 2)


@needs_pool
def test_one_thread_runs_inline(ext: ModuleType) -> None:
    torch.set_num_threads(1)
    runs, thread_of = ext.exercise(50, -1, 0)
    check_once(runs, thread_of, 1)


@needs_pool
def test_concurrent_callers_each_get_every_item(ext: ModuleType) -> None:
    # exercise() releases the GIL: one caller has the pool, the other falls back.
    results: list[tuple[torch.Tensor, torch.Tensor]] = []

    def call() -> None:
        for _ in range(20):
            results.append(ext.exercise(64, -1, 5000))

    callers = [threading.Thread(target=call) for _ in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert len(results) == 40
    for runs, thread_of in results:
        check_once(runs, thread_of, 2)


@needs_pool
def test_zero_spin_sleeps_and_still_runs_everything(ext: ModuleType) -> None:
    ext.set_spin_us(0)
    try:
        before = ext.stats()["sleeps"]
        for _ in range(5):
            runs, thread_of = ext.exercise(200, -1, 1000)
            check_once(runs, thread_of, 2)
        deadline = time.monotonic() + 10
        while ext.stats()["sleeps"] == before and time.monotonic() < deadline:
            time.sleep(0.01)  # the worker sleeps once it has seen a task end
        assert ext.stats()["sleeps"] > before
    finally:
        ext.set_spin_us(cpu_pool.DEFAULT_SPIN_US)


def _exercise_in_child(queue: multiprocessing.Queue) -> None:
    assert pool is not None
    torch.set_num_threads(2)
    runs, thread_of = pool.exercise(300, -1, 1000)
    queue.put((runs.tolist(), thread_of.tolist()))


@needs_pool
def test_a_forked_child_starts_its_own_workers(ext: ModuleType) -> None:
    ext.exercise(100, -1, 1000)  # the parent's worker exists before the fork
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_exercise_in_child, args=(queue,))
    child.start()
    runs, thread_of = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert runs == [1] * 300
    assert set(thread_of) <= {0, 1}


@pytest.mark.skipif(not cpu_gemm.available() or pool is None, reason="no AVX512-BF16 kernel")
def test_gemm_bits_equal_through_the_pool_and_openmp() -> None:
    ext = cpu_gemm.load()
    assert ext is not None
    x = torch.randn(37, 576).bfloat16()
    w = torch.randn(200, 576).bfloat16()
    packed = cpu_gemm.pack_tiles(w)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        via_pool = ext.gemm(x, packed, 200, None, False)
        ext.set_pool(None)
        via_openmp = ext.gemm(x, packed, 200, None, False)
    finally:
        cpu_pool.bind(ext)
        torch.set_num_threads(threads)
    assert torch.equal(via_pool, via_openmp)


def test_default_serial_step_tokens_follows_where_the_gemms_run() -> None:
    cpu = torch.device("cpu")
    assert default_serial_step_tokens(torch.float32, cpu) == SERIAL_STEP_TOKENS
    on_pool = cpu_linear.pick_packing(torch.bfloat16, cpu) == "tiles" and pool is not None
    assert default_serial_step_tokens(torch.bfloat16, cpu) == (0 if on_pool else SERIAL_STEP_TOKENS)
