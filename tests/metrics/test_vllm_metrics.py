"""The ``vllm:*`` series: vLLM's names and labels, each equal to its ``pagewarden:*`` twin."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagewarden.metrics.prometheus import build_registry, render
from pagewarden.metrics.stats import FrontendStatsRecorder
from tests.metrics.test_prometheus import _ROOT, _stats

#: vLLM name (as scraped) -> the pagewarden twin it must equal, for the unlabelled series.
TWINS = {
    "vllm:num_requests_running": "pagewarden:num_requests_running",
    "vllm:num_requests_waiting": "pagewarden:num_requests_waiting",
    "vllm:num_requests_swapped": "pagewarden:num_requests_swapped",
    "vllm:kv_cache_usage_perc": "pagewarden:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "pagewarden:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total": "pagewarden:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "pagewarden:prefix_cache_hits_total",
    "vllm:num_preemptions_total": "pagewarden:num_preemptions_total",
    "vllm:prompt_tokens_total": "pagewarden:prompt_tokens_total",
    "vllm:generation_tokens_total": "pagewarden:generation_tokens_total",
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "pagewarden:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "pagewarden:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds": "pagewarden:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds": "pagewarden:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "pagewarden:request_queue_time_seconds",
    "vllm:request_prompt_tokens": "pagewarden:request_prompt_tokens",
    "vllm:request_generation_tokens": "pagewarden:request_generation_tokens",
}


def _recorder() -> FrontendStatsRecorder:
    rec = FrontendStatsRecorder()
    for k in range(5):
        rec.first_token(0.01 * (k + 1), 0.002 * k)
        rec.inter_token(0.003 * (k + 1))
        rec.finished("stop" if k % 2 else "length", 0.5 * (k + 1), 10 * k + 3, 7 * k)
    rec.finished("abort", 0.1)
    return rec


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels without model_name/engine) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def check_twins(text: str) -> None:
    """Every vLLM series is present with vLLM's labels and equals its pagewarden twin."""
    got = samples(text)
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:") and family.name != "vllm:cache_config_info":
            for s in family.samples:
                assert s.labels["model_name"] and s.labels["engine"] == "0", s
    for v, p in TWINS.items():
        assert got[(v, frozenset())] == got[(p, frozenset())], v
    for v, p in HISTOGRAMS.items():
        twin = {(n.replace(p, v, 1), lab): x for (n, lab), x in got.items() if n.startswith(p)}
        mine = {(n, lab): x for (n, lab), x in got.items() if n.startswith(v + "_")}
        assert mine == twin and len(mine) > 3, v
    reasons = {"stop", "length", "abort", "error"}
    for reason in reasons:
        key = frozenset({("finished_reason", reason)})
        assert (
            got[("vllm:request_success_total", key)]
            == got[("pagewarden:request_success_total", key)]
        )


def test_vllm_twins_agree_with_pagewarden_metrics() -> None:
    cache_config = {"block_size": "16", "num_gpu_blocks": "100"}
    registry = build_registry(_stats, _recorder().snapshot, "m", True, cache_config)
    text = render(registry)[0].decode()
    check_twins(text)
    got = samples(text)
    stats = _stats()
    host_used = (stats.host_blocks - stats.free_host_blocks) / stats.host_blocks
    assert got[("vllm:cpu_cache_usage_perc", frozenset())] == pytest.approx(host_used)
    assert got[("vllm:cache_config_info", frozenset(cache_config.items()))] == 1
    assert got[("vllm:request_prompt_tokens_sum", frozenset())] == 3 + 13 + 23 + 33 + 43
    assert got[("vllm:num_requests_running", frozenset())] > 0  # distinct, nonzero values
    assert got[("vllm:request_success_total", frozenset({("finished_reason", "abort")}))] == 1
    assert got[("vllm:time_to_first_token_seconds_count", frozenset())] == 5


def test_vllm_metrics_can_be_turned_off() -> None:
    registry = build_registry(_stats, _recorder().snapshot, "m", vllm_metrics=False)
    text = render(registry)[0].decode()
    assert "vllm:" not in text


def test_vllm_names_are_documented() -> None:
    docs = (_ROOT / "README.md").read_text()
    docs += "".join(p.read_text() for p in sorted((_ROOT / "docs").rglob("*.md")))
    extra = ["vllm:request_success_total", "vllm:cpu_cache_usage_perc", "vllm:cache_config_info"]
    for name in [*TWINS, *extra, *HISTOGRAMS]:
        assert f"`{name}" in docs, name
