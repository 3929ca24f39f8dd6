"""The tier fault kinds of ``chaos/tiers.py`` through a real ``pagewarden serve`` with a
disk tier: entries damaged between requests, outputs equal to the fault-free run, and
``pagewarden:kv_tier_rejected_total`` rises with the expected reason."""

from __future__ import annotations

import random
import re
import shutil
import time
from pathlib import Path

import httpx
import torch

from pagewarden.chaos.tiers import TierEntries, damage_entries
from pagewarden.engine.kv_tiers import model_fingerprint
from pagewarden.kvstore.format import KVLayout, Namespace, RejectReason
from pagewarden.models.loader import load_model
from tests.kvstore.test_serve_restart import PROMPTS, _complete, _free_port, _kill, _start

# kind -> the rejection reasons it may produce (a header bit may land in any field).
KINDS = {
    "bitflip": {"checksum"},
    "header_bitflip": {r.value for r in RejectReason} - {"checksum", "pool_checksum"},
    "truncated": {"truncated", "size"},
    "swapped": {"key"},
    "other_model": {"model"},
    "other_layout": {"layout", "size", "truncated"},
    "stale_model": {"model"},
}


def _namespace(model_dir: Path) -> Namespace:
    """The namespace the server's tier uses (float32, block size 4), computed here."""
    loaded = load_model(str(model_dir), torch.float32)
    cfg = loaded.config
    layout = KVLayout(4, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, "float32")
    return Namespace(model_fingerprint(loaded.model, cfg, torch.float32), layout)


def _tier_counts(port: int, family: str) -> dict[str, float]:
    """``family``'s disk samples by reason (or "" without one)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    out: dict[str, float] = {}
    for labels, value in re.findall(rf"^pagewarden:{family}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if 'tier="disk"' in labels:
            reason = re.search(r'reason="([^"]*)"', labels)
            out[reason.group(1) if reason else ""] = float(value)
    return out


def _settled(offload: Path) -> list[Path]:
    """The tier's files once the server's writer stopped adding any."""
    seen = -1
    files: list[Path] = []
    for _ in range(100):
        files = sorted(offload.rglob("*.kvb"))
        if len(files) == seen:
            break
        seen = len(files)
        time.sleep(0.3)
    return files


def test_tier_faults_through_a_real_server(tiny_llama_dir, tmp_path):
    ns = _namespace(tiny_llama_dir)
    offload = tmp_path / "kv"
    port = _free_port()
    proc = _start(tiny_llama_dir, offload, port)
    try:
        # Each prompt alone, in order: each pass evicts every earlier prompt to the tier.
        reference = [_complete(port, p) for p in PROMPTS]  # an empty tier: fault-free
        _settled(offload)
        assert [_complete(port, p) for p in PROMPTS] == reference
        assert _tier_counts(port, "kv_tier_hits_total")[""] >= 9  # clean loads served
        rng = random.Random(0)
        for kind, reasons in KINDS.items():
            # A fresh tier for each kind: a damaged entry behind a chain's first miss is
            # never read, and would be rejected with its old reason in a later pass.
            for path in _settled(offload):
                path.unlink()
            assert [_complete(port, p) for p in PROMPTS] == reference, kind
            files = _settled(offload)
            assert files, kind
            before = _tier_counts(port, "kv_tier_rejected_total")
            assert damage_entries(kind, TierEntries(files), ns, rng) >= 2, kind
            assert [_complete(port, p) for p in PROMPTS] == reference, kind
            after = _tier_counts(port, "kv_tier_rejected_total")
            rose = {r for r, n in after.items() if n > before.get(r, 0.0)}
            assert rose and rose <= reasons, (kind, before, after)
        # The directory disappears under the running server: misses and errors, same tokens.
        shutil.rmtree(offload)
        assert [_complete(port, p) for p in PROMPTS] == reference
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        _kill(proc)
