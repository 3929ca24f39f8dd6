"""bench/llamacpp.py reads llama.cpp's outputs and computes pagewarden's figures the way
llama-bench and llama-batched-bench define theirs."""

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_llamacpp", Path(__file__).resolve().parents[1] / "bench" / "llamacpp.py"
)
lcb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lcb)


def _row(p, g, fa, samples):
    return {
        "n_prompt": p,
        "n_gen": g,
        "flash_attn": fa,
        "avg_ts": sum(samples) / len(samples),
        "samples_ts": samples,
    }


def test_llama_bench_rows_keyed_by_test_and_flash_attention_median_of_samples():
    rows = [
        _row(128, 0, 0, [300.0, 100.0, 290.0]),
        _row(0, 128, 0, [120.0, 110.0, 125.0]),
        _row(128, 128, 1, [200.0, 210.0, 205.0]),
        _row(0, 128, True, [130.0]),
    ]
    figs = lcb.llama_bench_figures(rows)
    assert figs == {
        "pp128 fa0": 290.0,
        "tg128 fa0": 120.0,
        "pp128+tg128 fa1": 205.0,
        "tg128 fa1": 130.0,
    }
    assert lcb.best_of([figs], "tg128") == 130.0
    assert lcb.best_of([figs], "pp128") == 290.0  # not the pp128+tg128 row
    with pytest.raises(lcb.BenchOutputError):
        lcb.best_of([figs], "pp512")


def test_batched_bench_jsonl_row_for_the_stream_count():
    out = "\n".join(
        [
            "main: n_kv_max = 16384",
            '{"pp": 128, "tg": 128, "pl": 1, "speed_pp": 9.0, "speed_tg": 9.0, "speed": 9.0}',
            '{"pp": 128, "tg": 128, "pl": 64, "speed_pp": 400.5, "speed_tg": 250.0, "speed": 300.25}',
        ]
    )
    assert lcb.batched_bench_figures(out) == {"S_PP": 400.5, "S_TG": 250.0, "S": 300.25}
    with pytest.raises(lcb.BenchOutputError):
        lcb.batched_bench_figures(out, pl=32)


def test_pagewarden_figures_use_llama_cpps_definitions():
    # one stream: prefill 0.5 s; prefill + 128 decode steps 1.5 s, then 0.5 / 2.5 s
    figs = lcb.pagewarden_figures([0.5, 0.5, 0.5], [1.5, 2.5, 1.5], streams=1)
    assert figs["pp"] == pytest.approx(128 / 0.5)
    assert figs["tg"] == pytest.approx(128 / 1.0)  # median of 128/1.0, 128/2.0, 128/1.0
    assert figs["pg"] == pytest.approx(256 / 1.5)  # prompt tokens counted, as -pg does
    batch = lcb.pagewarden_figures([4.0], [20.0], streams=64)
    assert batch == pytest.approx(
        {"pp": 64 * 128 / 4.0, "tg": 64 * 128 / 16.0, "pg": 64 * 256 / 20.0}
    )
    with pytest.raises(ValueError):
        lcb.pagewarden_figures([1.0], [1.0, 2.0], streams=1)


def test_llama_env_keeps_the_users_policy_unless_told_and_finds_the_libraries(monkeypatch):
    monkeypatch.setattr(lcb, "USER_ENV", {"PATH": "/bin", "LD_LIBRARY_PATH": "/opt/lib"})
    env = lcb.llama_env(Path("/x/bin"), "inherit")
    assert "OMP_WAIT_POLICY" not in env and env["LD_LIBRARY_PATH"] == "/x/bin:/opt/lib"
    assert lcb.llama_env(Path("/x/bin"), "PASSIVE")["OMP_WAIT_POLICY"] == "PASSIVE"


def _tokens_module():
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)  # llamacpp_tokens imports bench.quant_tokens' prompts
    return importlib.import_module("bench.llamacpp_tokens")


def test_greedy_tool_output_parsed_into_prompt_and_generated_ids():
    lct = _tokens_module()
    out = "prompt: 504 3575\ngen: 7042 30 198\nprompt: 1\ngen: 2 3 4\n"
    assert lct.parse_greedy_output(out) == [([504, 3575], [7042, 30, 198]), ([1], [2, 3, 4])]
    with pytest.raises(lct.GreedyToolError):
        lct.parse_greedy_output("prompt: 1\n")


def test_common_prefix_counts_leading_equal_tokens():
    lct = _tokens_module()
    assert lct.common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert lct.common_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert lct.common_prefix([7], [8]) == 0


def test_divergence_gap_is_our_margin_over_llama_cpps_token_at_the_first_difference():
    lct = _tokens_module()
    top = [[(5, -0.1), (6, -0.5)], [(7, -1.0), (8, -1.25), (9, -3.0)]]
    assert lct.divergence_gap([5, 7], top, [5, 8]) == pytest.approx(0.25)
    assert lct.divergence_gap([5, 7], top, [5, 4]) is None  # outside our top list
    assert lct.divergence_gap([5, 7], top, [5, 7]) is None  # never differ
