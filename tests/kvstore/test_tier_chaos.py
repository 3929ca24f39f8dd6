"""Every tier fault kind, at standard and strict: 0 corrupted tokens, each caught as it should."""

from __future__ import annotations

import pytest

from pagewarden.chaos.tiers import TIER_FAULT_KINDS, run_tier_chaos
from pagewarden.engine.config import EngineConfig
from pagewarden.models.loader import load_model

pytest.importorskip("redis")

EXPECTED = {  # kind -> the rejection reasons it may cause
    "bitflip": {"checksum"},
    "header_bitflip": {"header", "magic", "version", "truncated"},
    "truncated": {"truncated", "size", "header"},
    "swapped": {"key"},
    "other_model": {"model"},
    "other_layout": {"layout"},
    "stale_model": {"model"},
    "redis_crosswire": {"key"},
}


@pytest.mark.parametrize("integrity", ["standard", "strict"])
def test_tier_faults_serve_no_corrupted_token(tiny_llama_dir, redis_server, integrity):
    loaded = load_model(str(tiny_llama_dir), EngineConfig(dtype="float32").torch_dtype)
    report = run_tier_chaos(
        model=str(tiny_llama_dir),
        integrity=integrity,
        redis_url=redis_server.url,
        num_requests=5,
        prompt_len=40,
        max_tokens=4,
        block_size=4,
        loaded=loaded,
    )
    print(report.table())
    assert [r.kind for r in report.rows] == list(TIER_FAULT_KINDS)
    assert report.corrupted_tokens == 0
    for row in report.rows:
        assert row.outputs_equal, row
        reasons = {key.split("/")[1] for key in row.rejected}
        if row.kind in EXPECTED:
            assert row.damaged > 0, row
            assert reasons and reasons <= EXPECTED[row.kind], row
        else:  # a tier that hangs or disappears: misses and errors, nothing rejected
            assert not reasons and row.errors > 0, row
