"""``pagewarden chaos --scenario tiers``: faults in the KV tiers (disk, Redis).

A prefix-heavy workload runs once without tiers (the reference), once to fill the tiers,
then once per fault kind on a new engine (a restart: an empty pool, a warm tier) after the
tiers' entries were damaged. Every run is greedy, so every output must equal the
reference; a token that differs is a corrupted token served. The report gives, per kind,
the entries damaged, the tier hits, the rejections by reason and the corrupted tokens.

Kinds (``TIER_FAULT_KINDS``):

=================  ==========================================================================
bitflip            one bit of the K/V payload of each damaged entry
header_bitflip     one bit of the header (a token id, the model digest, a length...)
truncated          entries cut short (a torn write, a full disk)
swapped            two entries' contents exchanged (a file renamed over another)
other_model        entries re-written by another model with the same KV layout, under our keys
other_layout       entries re-written with another KV layout (head_dim, dtype), under our keys
stale_model        entries written before the weights changed (same architecture and config)
redis_crosswire    Redis values exchanged between keys (needs a Redis tier)
tier_hang          every Redis call hangs (a server that accepts and never answers)
tier_gone          the disk tier's directory is deleted while the engine runs
=================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core import EngineCore
from pagewarden.kvstore.checksum import block_checksum
from pagewarden.kvstore.disk import DiskTier
from pagewarden.kvstore.format import (
    BlockIdentity,
    KVLayout,
    ModelFingerprint,
    Namespace,
    encode_entry,
)
from pagewarden.kvstore.redis_tier import RedisTier
from pagewarden.models.loader import LoadedModel, load_model
from pagewarden.sampling_params import SamplingParams

TIER_FAULT_KINDS = (
    "bitflip",
    "header_bitflip",
    "truncated",
    "swapped",
    "other_model",
    "other_layout",
    "stale_model",
    "redis_crosswire",
    "tier_hang",
    "tier_gone",
)


@dataclass(frozen=True)
class TierFaultRow:
    kind: str
    damaged: int  # entries damaged (0 for the tier-wide kinds)
    hits: int  # blocks the faulty run loaded from the tiers (verified)
    rejected: dict[str, int]  # "tier/reason" -> entries rejected
    errors: int  # tier calls that failed or timed out
    corrupted_tokens: int
    outputs_equal: bool


@dataclass
class TierChaosReport:
    integrity: str
    tiers: list[str]
    num_requests: int
    rows: list[TierFaultRow] = field(default_factory=list)

    @property
    def corrupted_tokens(self) -> int:
        return sum(r.corrupted_tokens for r in self.rows)

    def table(self) -> str:
        lines = [
            f"tier faults, integrity={self.integrity}, tiers={','.join(self.tiers)}, "
            f"{self.num_requests} requests per run",
            f"{'kind':<16} {'damaged':>7} {'hits':>5} {'errors':>6} {'corrupted':>9} "
            f"{'equal':>5}  rejected (tier/reason)",
        ]
        for r in self.rows:
            rejected = ", ".join(f"{k}={v}" for k, v in sorted(r.rejected.items())) or "-"
            lines.append(
                f"{r.kind:<16} {r.damaged:>7} {r.hits:>5} {r.errors:>6} "
                f"{r.corrupted_tokens:>9} {str(r.outputs_equal):>5}  {rejected}"
            )
        lines.append(f"corrupted tokens served from a tier: {self.corrupted_tokens}")
        return "\n".join(lines)


def make_tier_workload(
    vocab_size: int, num_requests: int, prompt_len: int, seed: int
) -> list[list[int]]:
    """``num_requests`` distinct prompts (no shared prefix: each one's blocks come back
    only from a tier once the pool has evicted them)."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 4)
    return [
        [rng.randrange(low, vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)
    ]


def _run(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt alone, in order (so later ones evict earlier ones' blocks)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = []
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
        result: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    result = list(out.outputs[0].token_ids)
        outputs.append(result)
        if engine.kv_tiers is not None:
            engine.kv_tiers.flush()
    return outputs


def _disk_entries(engine: EngineCore) -> list[Path]:
    assert engine.kv_tiers is not None
    return sorted(
        p for t in engine.kv_tiers.tiers if isinstance(t, DiskTier) for p in t.dir.rglob("*.kvb")
    )


def _redis(engine: EngineCore) -> RedisTier | None:
    assert engine.kv_tiers is not None
    return next((t for t in engine.kv_tiers.tiers if isinstance(t, RedisTier)), None)


class TierEntries:
    """Every stored entry of some tiers (files of a disk tier, keys of a Redis tier),
    read and written back as bytes."""

    def __init__(self, files: list[Path], redis: RedisTier | None = None) -> None:
        self.files = files
        self.redis = redis
        self.redis_keys = (
            sorted(self.redis.client.scan_iter(match=self.redis.prefix + "*"))
            if self.redis is not None
            else []
        )

    def all(self) -> list[tuple[str, object]]:
        return [("disk", p) for p in self.files] + [("redis", k) for k in self.redis_keys]

    def read(self, where: str, ref: object) -> bytes:
        if where == "disk":
            assert isinstance(ref, Path)
            return ref.read_bytes()
        assert self.redis is not None
        value = self.redis.client.get(ref)
        assert isinstance(value, bytes)
        return value

    def write(self, where: str, ref: object, data: bytes) -> None:
        if where == "disk":
            assert isinstance(ref, Path)
            ref.write_bytes(data)
        else:
            assert self.redis is not None
            self.redis.client.set(ref, data)


def _reencode(data: bytes, ns: Namespace, foreign: Namespace) -> bytes:
    """An entry of ``ns`` re-written as ``foreign`` would write it (same block, tokens)."""
    layout = ns.layout
    header_len = len(data) - layout.payload_bytes
    n = layout.block_size
    block_hash, has_parent, parent = data[128:160], data[160], data[161:193]
    tokens = data[197 : 197 + 4 * n]
    payload = data[header_len:]
    ident = BlockIdentity(block_hash, parent if has_parent else None, tokens)  # type: ignore[arg-type]
    fl = foreign.layout
    if fl.payload_bytes != len(payload):  # another layout: a payload of its own size
        payload = (payload * (fl.payload_bytes // len(payload) + 1))[: fl.payload_bytes]
    checksum = block_checksum(payload, fl.num_layers, fl.block_size)
    return encode_entry(foreign, ident, checksum, payload)


def damage(kind: str, engine: EngineCore, rng: random.Random) -> int:
    """Damage the tiers' entries as ``kind`` says; returns how many entries changed."""
    assert engine.kv_tiers is not None
    entries = TierEntries(_disk_entries(engine), _redis(engine))
    return damage_entries(kind, entries, engine.kv_tiers.ns, rng)


def damage_entries(kind: str, entries: TierEntries, ns: Namespace, rng: random.Random) -> int:
    """Damage ``entries`` (of namespace ``ns``) as ``kind`` says (the entry kinds: not
    ``tier_hang``, ``tier_gone``); returns how many entries changed. Also for a tier
    that another process serves from (a real server's directory)."""
    targets = entries.all()
    header_len = ns.entry_bytes - ns.layout.payload_bytes
    if kind in ("bitflip", "header_bitflip", "truncated"):
        for where, ref in targets:
            data = bytearray(entries.read(where, ref))
            if kind == "truncated":
                data = data[: rng.randrange(1, len(data))]
            else:
                lo, hi = (header_len, len(data)) if kind == "bitflip" else (0, header_len)
                bit = rng.randrange(lo * 8, hi * 8)
                data[bit // 8] ^= 1 << (bit % 8)
            entries.write(where, ref, bytes(data))
        return len(targets)
    if kind in ("swapped", "redis_crosswire"):
        pool = [t for t in targets if kind == "swapped" or t[0] == "redis"]
        rng.shuffle(pool)
        changed = 0
        for (w1, r1), (w2, r2) in zip(pool[0::2], pool[1::2]):
            a, b = entries.read(w1, r1), entries.read(w2, r2)
            entries.write(w1, r1, b)
            entries.write(w2, r2, a)
            changed += 2
        return changed
    if kind in ("other_model", "other_layout", "stale_model"):
        fp, layout = ns.fingerprint, ns.layout
        if kind == "other_model":
            foreign = Namespace(
                ModelFingerprint("OtherForCausalLM", "0" * 64, "1" * 64, fp.dtype), layout
            )
        elif kind == "stale_model":
            foreign = Namespace(dataclasses.replace(fp, weights_digest="f" * 64), layout)
        else:
            other = KVLayout(
                layout.block_size,
                layout.num_layers,
                layout.num_kv_heads,
                layout.head_dim * 2,
                layout.dtype,
            )
            foreign = Namespace(fp, other)
        for where, ref in targets:
            entries.write(where, ref, _reencode(entries.read(where, ref), ns, foreign))
        return len(targets)
    return 0


class _BlackHole:
    """A TCP listener that accepts connections and never answers (a hung Redis)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        self.held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for s in self.held:
            s.close()


def _corrupted_tokens(got: list[list[int]], reference: list[list[int]]) -> int:
    """Tokens that differ from the fault-free run's, missing or extra ones included."""
    return sum(
        sum(a != b for a, b in zip(g, r)) + abs(len(g) - len(r)) for g, r in zip(got, reference)
    )


def run_tier_chaos(
    model: str | None = None,
    integrity: str = "strict",
    kinds: tuple[str, ...] = TIER_FAULT_KINDS,
    redis_url: str | None = None,
    num_requests: int = 6,
    prompt_len: int = 64,
    max_tokens: int = 8,
    block_size: int = 8,
    dtype: str = "float32",
    seed: int = 0,
    loaded: LoadedModel | None = None,
) -> TierChaosReport:
    """Run the workload without tiers, then with each kind of tier fault; compare."""
    if loaded is None:
        loaded = load_model(model, EngineConfig(dtype=dtype).torch_dtype)
    prompts = make_tier_workload(loaded.config.vocab_size, num_requests, prompt_len, seed)
    per_prompt = (prompt_len + max_tokens + block_size - 1) // block_size
    base = EngineConfig(
        model=model,
        dtype=dtype,
        block_size=block_size,
        num_kv_blocks=2 * per_prompt + 2,  # holds two prompts: the rest are evicted
        max_num_seqs=1,
        integrity=integrity,
        seed=seed,
        flight_recorder_steps=0,
        kv_offload_timeout=0.3,
    )
    reference = _run(EngineCore(base, loaded), prompts, max_tokens)
    if redis_url is None:
        kinds = tuple(k for k in kinds if k not in ("redis_crosswire", "tier_hang"))
    tiers = ["disk"] + (["redis"] if redis_url else [])
    report = TierChaosReport(integrity, tiers, num_requests)
    rng = random.Random(seed + 1)
    for kind in kinds:
        workdir = Path(tempfile.mkdtemp(prefix="pagewarden-tier-chaos-"))
        hole: _BlackHole | None = None
        try:
            cfg = dataclasses.replace(base, kv_offload_dir=str(workdir), kv_offload_redis=redis_url)
            filler = EngineCore(cfg, loaded)
            scratch = _redis(filler)
            if scratch is not None:  # this model's namespace only: each kind starts empty
                for key in list(scratch.client.scan_iter(match=scratch.prefix + "*")):
                    scratch.client.delete(key)
            _run(filler, prompts, max_tokens)
            damaged = damage(kind, filler, rng)
            assert filler.kv_tiers is not None
            filler.kv_tiers.close()
            if kind == "tier_hang":
                hole = _BlackHole()
                cfg = dataclasses.replace(cfg, kv_offload_redis=hole.url)
            if kind == "redis_crosswire":  # Redis alone: the disk would serve first
                cfg = dataclasses.replace(cfg, kv_offload_dir=None)
            engine = EngineCore(cfg, loaded)
            if kind == "tier_gone":
                shutil.rmtree(workdir)
            got = _run(engine, prompts, max_tokens)
            assert engine.kv_tiers is not None
            stats = engine.kv_tiers.stats()
            engine.kv_tiers.close()
            corrupted = _corrupted_tokens(got, reference)
            report.rows.append(
                TierFaultRow(
                    kind,
                    damaged,
                    sum(stats.hits.values()),
                    {f"{t}/{r}": n for (t, r), n in stats.rejected.items()},
                    sum(stats.errors.values()),
                    corrupted,
                    got == reference,
                )
            )
        finally:
            if hole is not None:
                hole.close()
            shutil.rmtree(workdir, ignore_errors=True)
    return report
