"""EngineConfig and SchedulerConfig agree on the shortest usable context."""

from __future__ import annotations

import pytest

from pagewarden.engine.config import EngineConfig, EngineConfigError
from pagewarden.sched.config import MIN_MAX_MODEL_LEN, SchedulerConfig


def test_engine_and_scheduler_agree_on_the_minimum_max_model_len() -> None:
    too_short = MIN_MAX_MODEL_LEN - 1
    with pytest.raises(EngineConfigError, match=f">= {MIN_MAX_MODEL_LEN}"):
        EngineConfig(max_model_len=too_short)
    with pytest.raises(ValueError, match=f">= {MIN_MAX_MODEL_LEN}"):
        SchedulerConfig(num_blocks=4, max_model_len=too_short)
    assert EngineConfig(max_model_len=MIN_MAX_MODEL_LEN).max_model_len == MIN_MAX_MODEL_LEN
    assert SchedulerConfig(num_blocks=4, max_model_len=MIN_MAX_MODEL_LEN)


def test_cpu_flags_reach_the_engine_config() -> None:
    import argparse

    import pytest

    from pagewarden.engine.args import add_engine_args, engine_config
    from pagewarden.engine.config import EngineConfigError

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config(parser.parse_args(["--cpu-threads", "2", "--cpu-bind", "0-1"]))
    assert (cfg.cpu_threads, cfg.cpu_bind) == (2, "0-1")
    with pytest.raises(EngineConfigError):
        engine_config(parser.parse_args(["--cpu-threads", "0"]))
    with pytest.raises(EngineConfigError):
        engine_config(parser.parse_args(["--cpu-bind", "3-1"]))


def test_llm_takes_every_engine_config_field() -> None:
    """`pagewarden generate` builds an LLM from every EngineConfig field the flags set."""
    import inspect
    from dataclasses import fields

    from pagewarden.engine.config import EngineConfig
    from pagewarden.engine.llm import LLM

    params = set(inspect.signature(LLM.__init__).parameters) - {"self"}
    assert {f.name for f in fields(EngineConfig)} <= params
