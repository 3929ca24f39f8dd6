"""KV cache events: vLLM's wire format, and a ZeroMQ subscriber that rebuilds the cached
block set from them and finds exactly the engine's prefix-cache index."""

from __future__ import annotations

import sys
from typing import Any

import msgspec
import pytest
import zmq

from pagewarden.engine.config import EngineConfig, EngineConfigError
from pagewarden.engine.kv_events import (
    KVEventPublisher,
    KVEventsUnavailable,
    binds_remotely,
    external_hash,
    prompt_block_hashes,
    wire_events,
)
from pagewarden.engine.llm import LLM
from pagewarden.kv.block import BlockHash
from pagewarden.kv.cache_events import BlockRemoved, BlockStored
from pagewarden.sampling_params import SamplingParams


# vLLM's structs (vllm/distributed/kv_events.py), as its example subscriber copies them:
# the array-encoded events of vLLM <= 0.23 ...
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredV(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemovedV(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class AllBlocksClearedV(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStoredV | BlockRemovedV | AllBlocksClearedV]


# ... and the map-encoded events of later vLLM (the batch stays an array).
class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class MapRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class MapCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapEventBatch(EventBatch):
    events: list[MapStored | MapRemoved | MapCleared]


def _h(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(32, "big"))


POOL_EVENTS = [
    BlockStored(_h(1), None, [1, 2]),
    BlockStored(_h(2), _h(1), [3, 4]),  # same chain: merged with the one before
    BlockStored(_h(9), _h(5), [7, 8]),  # another chain: a new event
    BlockRemoved(_h(1)),
    BlockRemoved(_h(2)),
]


@pytest.mark.parametrize(
    ("encoding", "batch_type", "stored", "removed"),
    [
        ("array", KVEventBatch, BlockStoredV, BlockRemovedV),
        ("map", MapEventBatch, MapStored, MapRemoved),
    ],
)
def test_wire_format_decodes_with_vllm_structs(encoding, batch_type, stored, removed) -> None:
    wire = wire_events(POOL_EVENTS, block_size=2, encoding=encoding)
    payload = msgspec.msgpack.encode([123.5, wire, 0])
    batch = msgspec.msgpack.Decoder(type=batch_type).decode(payload)
    assert batch.ts == 123.5 and batch.data_parallel_rank == 0
    assert batch.events == [
        stored([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None),
        stored([9], 5, [7, 8], 2, None, "GPU", None),
        removed([1, 2], "GPU"),
    ]
    assert external_hash(_h(2**70 + 5)) == 5  # the low 64 bits, as vLLM sends its own


class Subscriber:
    """A SUB socket bound on a free loopback port; the engine's publisher connects."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.cached: set[int] = set()
        self.seqs: list[int] = []
        self.events: list[Any] = []

    def drain(self, quiet_s: float = 0.3) -> None:
        """Apply every message that arrives until none has for ``quiet_s``."""
        while self.sock.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"kv"
            self.seqs.append(int.from_bytes(seq, "big"))
            for e in self.decode(payload).events:
                self.events.append(e)
                if isinstance(e, BlockStoredV):
                    assert e.block_size == 4 and len(e.token_ids) == 4 * len(e.block_hashes)
                    assert e.parent_block_hash is None or e.parent_block_hash in self.cached
                    assert not self.cached & set(e.block_hashes), "stored twice"
                    self.cached |= set(e.block_hashes)
                elif isinstance(e, BlockRemovedV):
                    assert set(e.block_hashes) <= self.cached, "removed what was not stored"
                    self.cached -= set(e.block_hashes)
                else:
                    self.cached.clear()

    def close(self) -> None:
        self.sock.close(0)


def test_subscriber_rebuilds_the_engines_cached_block_set(tiny_llama_dir) -> None:
    sub = Subscriber()
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        block_size=4,
        num_kv_blocks=24,  # small: later prompts evict earlier prefixes
        max_model_len=128,
        kv_events_endpoint=f"tcp://127.0.0.1:{sub.port}",
        kv_events_topic="kv",
    )
    # The SUB socket sends its subscription when it next runs (as a subscriber's loop does).
    for _ in range(200):
        if llm.engine.kv_events.wait_for_subscriber(0.05):
            break
        sub.sock.poll(0)
    else:
        raise AssertionError("the subscription never reached the publisher")
    pool = llm.engine.scheduler.kv.pool
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    system = list(range(3, 15))  # a shared 12-token prefix: three full blocks
    try:
        for round_ in range(4):
            prompts = [
                {"prompt_token_ids": system + [20 + round_ * 7 + k] * (3 + k)} for k in range(3)
            ]
            llm.generate(prompts, params, use_tqdm=False)
            sub.drain()
            assert sub.cached == {external_hash(h) for h in pool.hash_index}, round_
            if round_ == 0:  # a router finds each prompt's blocks from its tokens alone
                for p in prompts:
                    ids = p["prompt_token_ids"]
                    hashes = prompt_block_hashes(ids, 4, llm.engine.loaded.name)
                    assert len(hashes) == len(ids) // 4 and set(hashes) <= sub.cached
        pool.quarantine(next(iter(pool.hash_index.values())).block_id)  # a fault
        llm.generate([{"prompt_token_ids": [40] * 9}], params, use_tqdm=False)
        sub.drain()
        assert sub.cached == {external_hash(h) for h in pool.hash_index}
    finally:
        sub.close()
        llm.engine.kv_events.close()
    assert sub.seqs == list(range(len(sub.seqs))) and len(sub.seqs) >= 5
    assert isinstance(sub.events[0], AllBlocksClearedV)
    assert any(isinstance(e, BlockRemovedV) for e in sub.events)  # eviction happened
    assert llm.stats().prefix_cache_hits > 0


def test_bad_endpoints_and_missing_packages_give_clear_errors(monkeypatch) -> None:
    with pytest.raises(ValueError, match="kv-events-endpoint"):
        KVEventPublisher("tcp://no-such-host-name:x", block_size=4)
    with pytest.raises(EngineConfigError, match="tcp://"):
        EngineConfig(kv_events_endpoint="localhost:5557")
    monkeypatch.setitem(sys.modules, "zmq", None)  # as if pyzmq were not installed
    with pytest.raises(KVEventsUnavailable, match=r"pagewarden\[kv-events\]"):
        KVEventPublisher("tcp://*:5557", block_size=4)


def test_without_token_ids_events_carry_hashes_only() -> None:
    wire = wire_events(POOL_EVENTS, block_size=2, token_ids=False)
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(
        msgspec.msgpack.encode([0.0, wire, 0])
    )
    stored = [e for e in batch.events if isinstance(e, BlockStoredV)]
    assert [e.block_hashes for e in stored] == [[1, 2], [9]]
    assert all(e.token_ids == [] for e in stored)


@pytest.mark.parametrize(
    ("endpoint", "remote"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://router-host:5557", False),  # connects out to a subscriber the operator named
        ("ipc:///tmp/kv", False),
    ],
)
def test_which_endpoints_bind_remotely(endpoint, remote) -> None:
    assert binds_remotely(endpoint) is remote


def _serve_args(*extra: str):
    from pagewarden.cli import build_parser

    return build_parser().parse_args(["serve", *extra])


def test_serve_refuses_a_wildcard_kv_events_bind_with_api_keys(caplog) -> None:
    from pagewarden.serve.cli import _check_limits

    keyed = ("--api-key", "k", "--kv-events-endpoint", "tcp://*:5557")
    with pytest.raises(SystemExit, match="kv-events-allow-remote"):
        _check_limits(_serve_args(*keyed))
    _check_limits(_serve_args("--kv-events-endpoint", "tcp://*:5557"))  # no keys: as vLLM
    _check_limits(_serve_args("--api-key", "k", "--kv-events-endpoint", "tcp://127.0.0.1:1"))
    _check_limits(_serve_args(*keyed, "--kv-events-allow-remote"))
    assert "carry prompt token ids" in caplog.text
    caplog.clear()
    args = _serve_args(*keyed, "--kv-events-allow-remote", "--kv-events-no-token-ids")
    _check_limits(args)
    assert args.kv_events_token_ids is False and "carry prompt token ids" not in caplog.text
