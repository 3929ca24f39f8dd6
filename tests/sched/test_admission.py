"""The one admission check: exact limits, the field to fix, and agreement with what the
scheduler can actually serve."""

from __future__ import annotations

import pytest

from pagewarden.sampling_params import SamplingParams
from pagewarden.sched import Request, RequestRejected, Scheduler, SchedulerConfig
from pagewarden.sched.admission import AdmissionLimits, check_request, max_kv_blocks
from pagewarden.sched.config import MIN_MAX_MODEL_LEN
from pagewarden.sched.fake_runner import FakeModelRunner

LIMITS = AdmissionLimits(max_model_len=32, block_size=4, usable_blocks=4, max_num_seqs=2)


def _params(**kw) -> SamplingParams:
    return SamplingParams(ignore_eos=True, **kw)


def test_max_kv_blocks_leaves_out_the_last_sampled_token() -> None:
    assert max_kv_blocks(12, 5, 4) == 4  # 16 positions computed, the 17th token is not
    assert max_kv_blocks(12, 6, 4) == 5
    assert max_kv_blocks(1, 1, 4) == 1


@pytest.mark.parametrize(
    ("prompt", "params", "param", "match"),
    [
        ([], _params(max_tokens=1), "prompt", "prompt is empty"),
        ([5, 99], _params(max_tokens=1), "prompt", r"integers in \[0, 50\)"),
        ([5, -1], _params(max_tokens=1), "prompt", r"integers in \[0, 50\)"),
        ([1] * 32, _params(max_tokens=None), "prompt", "no room"),
        ([1] * 30, _params(max_tokens=3), "max_tokens", "exceeds max_model_len=32"),
        ([1] * 12, _params(max_tokens=6), "max_tokens", "needs up to 5 KV blocks"),
        ([1] * 4, _params(max_tokens=1, n=3), "n", "exceeds max_num_seqs=2"),
    ],
)
def test_rejections_name_the_field_to_fix(prompt, params, param, match) -> None:
    limits = AdmissionLimits(32, 4, 4, 2, vocab_size=50)
    with pytest.raises(RequestRejected, match=match) as info:
        check_request(prompt, params, limits)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)


def test_accepted_requests_get_their_resolved_max_tokens() -> None:
    assert check_request([1] * 12, _params(max_tokens=5), LIMITS) == 5
    # None: up to the context length, if the pool can hold that much.
    limits = AdmissionLimits(16, 4, 4, 2)
    assert check_request([1] * 10, _params(max_tokens=None), limits) == 6


def test_the_largest_accepted_request_runs_to_completion_in_the_pool() -> None:
    """Exactly ``usable_blocks`` blocks: the scheduler admits it and serves every token."""
    cfg = SchedulerConfig(num_blocks=5, block_size=4, max_num_batched_tokens=64, max_model_len=32)
    s = Scheduler(cfg)
    assert s.admission_limits().usable_blocks == 4
    s.add_request(Request("a", list(range(1, 13)), _params(max_tokens=5)))
    with pytest.raises(RequestRejected, match="needs up to 5 KV blocks"):
        s.add_request(Request("b", list(range(1, 13)), _params(max_tokens=6)))
    runner = FakeModelRunner(4, verify=True)
    produced = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        assert not out.preempted_req_ids
        produced += len(s.update(out, runner.execute(out)))
        assert s.check_invariants() == []
    assert produced == 5 and s.kv.pool.num_free_blocks == 4


def test_shortest_context_is_one_prompt_and_one_output_token() -> None:
    with pytest.raises(ValueError, match=f"max_model_len must be >= {MIN_MAX_MODEL_LEN}"):
        SchedulerConfig(num_blocks=4, max_model_len=MIN_MAX_MODEL_LEN - 1)
    limits = AdmissionLimits(MIN_MAX_MODEL_LEN, 4, 4, 1)
    assert check_request([7], _params(max_tokens=None), limits) == 1
