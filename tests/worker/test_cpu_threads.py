"""--cpu-threads / --cpu-bind: parsing, validation, and their effect on this process."""

from __future__ import annotations

import os

import pytest
import torch

from pagewarden.engine.config import EngineConfig, EngineConfigError
from pagewarden.worker.cpu_threads import (
    CpuBindError,
    StepThreads,
    apply_cpu_threads,
    parse_cpu_list,
)


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list("2, 0,1-1") == [0, 1, 2]


@pytest.mark.parametrize("spec", ["", "a", "3-1", "-1", "0-"])
def test_bad_cpu_list_raises(spec: str) -> None:
    with pytest.raises(CpuBindError, match="cpu list"):
        parse_cpu_list(spec)


def test_engine_config_validates_threads_and_bind() -> None:
    with pytest.raises(EngineConfigError, match="cpu_threads"):
        EngineConfig(cpu_threads=0)
    with pytest.raises(EngineConfigError, match="cpu list"):
        EngineConfig(cpu_bind="x")
    assert EngineConfig(cpu_threads=2, cpu_bind="0").cpu_bind == "0"


def test_apply_sets_threads_and_affinity_of_every_thread() -> None:
    before_threads, before_cores = torch.get_num_threads(), os.sched_getaffinity(0)
    core = min(before_cores)
    try:
        apply_cpu_threads(None, str(core))
        assert torch.get_num_threads() == 1  # one per bound core
        for tid in os.listdir("/proc/self/task"):
            assert os.sched_getaffinity(int(tid)) == {core}
        apply_cpu_threads(3, None)
        assert torch.get_num_threads() == 3
    finally:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), before_cores)
        torch.set_num_threads(before_threads)


def test_bind_outside_allowed_cores_raises() -> None:
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(CpuBindError, match="outside"):
        apply_cpu_threads(None, str(outside))


def test_step_threads_runs_tiny_steps_on_one_thread() -> None:
    full = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        threads = StepThreads(serial_tokens=2)
        threads.before_step(1)
        assert torch.get_num_threads() == 1
        threads.before_step(2)
        assert torch.get_num_threads() == 1
        threads.before_step(3)
        assert torch.get_num_threads() == 2
        threads.before_step(64)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(full)
