"""logit_bias in the batch sampler: added to the named tokens' logits, greedy or sampled."""

from __future__ import annotations

import pytest
import torch

from pagewarden.sampling_params import SamplingParams, SamplingParamsError
from pagewarden.worker.sampler import Sampler, SamplingRow, apply_logit_bias

V = 50


def _row(**kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), [1, 2], [], seed=kw.get("seed"), sample_index=0)


def test_bias_is_added_per_row_in_one_batch():
    logits = torch.zeros(3, V)
    out = apply_logit_bias(logits, [{3: 5.0, 7: -2.5}, None, {3: 1.0}])
    assert out[0, 3] == 5.0 and out[0, 7] == -2.5 and out[2, 3] == 1.0
    assert out[1].abs().sum() == 0 and out[0].abs().sum() == 7.5
    assert logits.abs().sum() == 0  # the input is not modified


def test_bias_steers_greedy_and_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    best = int(logits[0].argmax())
    rows = [
        _row(temperature=0.0, logit_bias={11: 100.0}),
        _row(temperature=0.0, logit_bias={best: -100.0}),
        _row(temperature=1.0, seed=3, logit_bias={17: 100.0}),
        _row(temperature=0.0),
    ]
    out = Sampler(V)(logits.clone(), rows)
    assert out.token_ids[0] == 11
    assert out.token_ids[1] != best
    assert out.token_ids[2] == 17
    assert out.token_ids[3] == int(logits[3].argmax())


@pytest.mark.parametrize(
    "bias",
    [{1: 100.5}, {1: float("nan")}, {-1: 1.0}, {i: 1.0 for i in range(301)}, {True: 1.0}],
)
def test_out_of_range_bias_is_refused(bias):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias"


def test_bias_ids_are_checked_against_the_vocabulary():
    with pytest.raises(SamplingParamsError):
        SamplingParams(logit_bias={V: 1.0}).check_vocab(V)
    SamplingParams(logit_bias={V - 1: 1.0}).check_vocab(V)
