"""Every ``SamplingParams`` field is bounded; out-of-range values name their parameter."""

from __future__ import annotations

import pytest

from pagewarden.sampling_params import SamplingParams, SamplingParamsError

BIG = 2**64


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"n": 0}, "n"),
        ({"n": BIG}, "n"),
        ({"top_k": BIG}, "top_k"),
        ({"top_k": -5}, "top_k"),
        ({"logprobs": BIG}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_tokens": 10**20, "max_tokens": None}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"max_tokens": BIG}, "max_tokens"),
        ({"seed": BIG}, "seed"),
        ({"temperature": 1e300}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"top_p": 0.0}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop_token_ids": [BIG]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(2000))}, "stop_token_ids"),
        ({"stop": ["x"] * 100}, "stop"),
        ({"stop": "x" * 5000}, "stop"),
        ({"n": True}, "n"),
    ],
)
def test_out_of_range_is_rejected_with_its_name(kw, param):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kw)
    assert err.value.param == param


def test_vocab_bounds():
    SamplingParams(top_k=512, logprobs=512, stop_token_ids=[511]).check_vocab(512)
    for kw, param in (
        ({"top_k": 513}, "top_k"),
        ({"logprobs": 513}, "logprobs"),
        ({"stop_token_ids": [512]}, "stop_token_ids"),
    ):
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(**kw).check_vocab(512)
        assert err.value.param == param


def test_vllm_spellings_still_accepted():
    assert SamplingParams(top_k=-1).top_k is None and SamplingParams(top_k=0).top_k is None
    assert SamplingParams(seed=-(2**63), max_tokens=None, min_tokens=100).min_tokens == 100


def test_offline_engine_rejects_params_past_the_vocabulary(tiny_llama_dir):
    from pagewarden.engine.config import EngineConfig
    from pagewarden.engine.core import EngineCore, RequestRejected

    core = EngineCore(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=16))
    with pytest.raises(RequestRejected) as err:
        core.validate([1, 2, 3], SamplingParams(logprobs=100000))
    assert err.value.param == "logprobs"
