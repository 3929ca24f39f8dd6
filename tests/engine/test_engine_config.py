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


def test_quantization_defaults_to_auto_and_gguf_is_checked() -> None:
    """GGUF weights stay quantized by default where the kernels apply (auto,
    docs/quantization.md); float32 / float16 runs and GPUs keep the dense path under
    auto, and refuse gguf."""
    import argparse

    from pagewarden.engine.args import add_engine_args, engine_config

    assert EngineConfig().quantization == "auto"
    assert EngineConfig(device="cpu").resolved_quantization == "auto"
    assert EngineConfig(device="cpu", dtype="float32").resolved_quantization == "none"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args([])).quantization == "auto"
    cfg = engine_config(parser.parse_args(["--quantization", "gguf", "--device", "cpu"]))
    assert cfg.resolved_quantization == "gguf"
    assert EngineConfig(quantization="auto", device="cpu").resolved_quantization == "auto"
    for dtype in ("float32", "float16"):
        auto = EngineConfig(quantization="auto", dtype=dtype, device="cpu")
        assert auto.resolved_quantization == "none"
        with pytest.raises(EngineConfigError, match="bfloat16"):
            EngineConfig(quantization="gguf", dtype=dtype, device="cpu")
    with pytest.raises(EngineConfigError, match="quantization must be"):
        EngineConfig(quantization="q4")
