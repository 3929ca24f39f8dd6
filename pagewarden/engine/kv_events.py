"""KV cache events in vLLM's wire format, on a ZeroMQ PUB socket.

Prefix-aware routers (llm-d, NVIDIA Dynamo, AIBrix, the Gateway API Inference
Extension) subscribe to each replica's KV events to know which prefixes it caches.
After every step that changed the prefix-cache index, the engine publishes the block
pool's changes (``kv/cache_events.py``) as one message of three frames, as vLLM does::

    [topic (utf-8), seq (8-byte big-endian, from 0), payload (msgpack EventBatch)]

    EventBatch   [ts, [event, ...], data_parallel_rank]
    event        ["BlockStored", block_hashes, parent_block_hash, token_ids,
                  block_size, lora_id, medium, lora_name]
                 ["BlockRemoved", block_hashes, medium]
                 ["AllBlocksCleared"]

that is, vLLM's msgspec structs (``array_like=True``, ``tag=True``) up to its 0.23
releases, which every consumer decodes. ``encoding="map"`` sends each event as a map
with its tag under ``"type"`` (``{"type": "BlockStored", "block_hashes": [...], ...}``),
as vLLM does since its events switched to map encoding; the batch stays an array.

Block hashes are pagewarden's chained blake2b prefix hashes (``kv/prefix_hash.py``),
sent as vLLM sends its own by default: the low 64 bits of the digest as an unsigned
int. A BlockStored carries a run of consecutive blocks of one chain, its parent the
block before the run (None at a chain's start). ``medium`` is ``"GPU"``, vLLM's name
for the engine's own KV pool, on every device, and ``"DISK"`` or ``"REDIS"`` for a block
a KV tier stored or dropped (``kvstore/``, docs/kv-tiers.md). The first batch of a publisher starts
with AllBlocksCleared, so that a router forgets what an earlier engine process at the
same endpoint (one the supervisor restarted) had cached.

The endpoint is bound or connected by vLLM's rule: bound when it has a wildcard
(``tcp://*:5557``) or is ``ipc://`` / ``inproc://``; connected otherwise (to a
subscriber that binds, ``tcp://router-host:5557``). Sends never block: a subscriber
that falls behind ZeroMQ's high-water mark loses messages and sees a gap in ``seq``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

from pagewarden.kv.block import BlockHash
from pagewarden.kv.cache_events import BlockRemoved, BlockStored, CacheEvent
from pagewarden.kv.prefix_hash import encode_extra_keys, hash_block_chain

KVEventEncoding = Literal["array", "map"]

#: vLLM's name for the engine's own KV pool (as opposed to an offload tier).
MEDIUM = "GPU"
#: Messages a slow subscriber may have queued before newer ones are dropped (vLLM's).
SEND_HWM = 100_000


class KVEventsUnavailable(ValueError):
    """``--kv-events-endpoint`` was given but pyzmq or msgspec is not installed."""


def external_hash(block_hash: BlockHash) -> int:
    """The block hash as routers receive it: the digest's low 64 bits, unsigned."""
    return int.from_bytes(block_hash[-8:], "big")


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, model_id: str, cache_salt: str | None = None
) -> list[int]:
    """The hashes of a prompt's full blocks as this engine's BlockStored events carry
    them: what a prefix-aware router looks up in a replica's cached set. ``model_id`` is
    the engine's model name (``EngineInfo.model_name``), not a served alias."""
    extra = encode_extra_keys(model_id, cache_salt)
    return [external_hash(h) for h in hash_block_chain(token_ids, block_size, extra)]


def _stored(
    run: list[BlockStored], block_size: int, encoding: KVEventEncoding, token_ids: bool
) -> list | dict:
    parent = run[0].parent_hash
    fields = (
        ("block_hashes", [external_hash(e.block_hash) for e in run]),
        ("parent_block_hash", None if parent is None else external_hash(parent)),
        ("token_ids", [t for e in run for t in e.token_ids] if token_ids else []),
        ("block_size", block_size),
        ("lora_id", None),
        ("medium", run[0].medium),
        ("lora_name", None),
    )
    return _event("BlockStored", fields, encoding)


def _event(tag: str, fields: tuple, encoding: KVEventEncoding) -> list | dict:
    if encoding == "map":
        return {"type": tag, **dict(fields)}
    return [tag, *(value for _, value in fields)]


def wire_events(
    events: Sequence[CacheEvent],
    block_size: int,
    encoding: KVEventEncoding = "array",
    token_ids: bool = True,
) -> list:
    """The pool's events as vLLM's, in order; consecutive stores of one chain (each the
    parent of the next) and consecutive removals are merged into one event each. Without
    ``token_ids`` a BlockStored carries an empty token list (hashes only)."""
    out: list = []
    run: list[BlockStored] = []
    removed: list[int] = []
    removed_medium = MEDIUM

    def flush() -> None:
        if run:
            out.append(_stored(run, block_size, encoding, token_ids))
            run.clear()
        if removed:
            fields = (("block_hashes", list(removed)), ("medium", removed_medium))
            out.append(_event("BlockRemoved", fields, encoding))
            removed.clear()

    for e in events:
        if isinstance(e, BlockStored):
            if removed or (
                run and (e.parent_hash != run[-1].block_hash or e.medium != run[-1].medium)
            ):
                flush()
            run.append(e)
        else:
            assert isinstance(e, BlockRemoved)
            if run or (removed and e.medium != removed_medium):
                flush()
            removed_medium = e.medium
            removed.append(external_hash(e.block_hash))
    flush()
    return out


class KVEventPublisher:
    """Publishes the block pool's cache events as vLLM KV events (see the module doc).

    Owned by the engine-core thread: ``publish`` is called between steps, never
    concurrently. ``close`` waits up to ``linger_s`` for queued messages to leave."""

    def __init__(
        self,
        endpoint: str,
        block_size: int,
        topic: str = "",
        encoding: str = "array",
        data_parallel_rank: int = 0,
        linger_s: float = 1.0,
        token_ids: bool = True,
    ) -> None:
        try:
            import msgspec
            import zmq
        except ImportError as exc:
            raise KVEventsUnavailable(
                f"--kv-events-endpoint needs pyzmq and msgspec ({exc.name} is missing): "
                "pip install 'pagewarden[kv-events]'"
            ) from exc
        if encoding not in ("array", "map"):
            raise ValueError(f"KV event encoding must be 'array' or 'map', got {encoding!r}")
        self.endpoint = endpoint
        self.block_size = block_size
        self.token_ids = token_ids
        self.encoding: KVEventEncoding = "map" if encoding == "map" else "array"
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._encode = msgspec.msgpack.Encoder().encode
        self._zmq = zmq
        # XPUB: a PUB socket (subscribers see no difference) that also reports
        # subscriptions, so that wait_for_subscriber can tell when one has arrived.
        self._socket = zmq.Context.instance().socket(zmq.XPUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.LINGER, int(linger_s * 1000))
        try:
            if _binds(endpoint):
                self._socket.bind(endpoint)
            else:
                self._socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(0)
            raise ValueError(f"--kv-events-endpoint {endpoint!r}: {exc}") from exc
        self.seq = 0  # the sequence number of the next message
        # Sent with the first batch, not alone now: a subscriber's subscription reaches a
        # new PUB socket a moment after it starts, and PUB drops what no one subscribed to.
        self._clear: list | None = [_event("AllBlocksCleared", (), encoding)]

    def wait_for_subscriber(self, timeout_s: float) -> bool:
        """Wait until a subscription has reached the socket (True) or ``timeout_s`` has
        passed (False). A subscriber's subscription arrives a moment after it connects,
        and messages published before that are not delivered to it."""
        if self._socket.poll(int(timeout_s * 1000)):
            self._socket.recv()  # b"\x01" + topic: a subscription
            return True
        return False

    def publish(self, events: Sequence[CacheEvent]) -> None:
        """Send ``events`` as one EventBatch (nothing when there are none)."""
        if events:
            wire = wire_events(events, self.block_size, self.encoding, self.token_ids)
            if self._clear is not None:
                wire, self._clear = self._clear + wire, None
            self._send(wire)

    def _send(self, wire: list) -> None:
        payload = self._encode([time.time(), wire, self._rank])
        frames = (self._topic, self.seq.to_bytes(8, "big"), payload)
        try:
            self._socket.send_multipart(frames, flags=self._zmq.NOBLOCK)
        except self._zmq.Again:  # no peer yet or at the high-water mark: dropped, as PUB does
            pass
        self.seq += 1

    def close(self) -> None:
        self._socket.close()


def binds_remotely(endpoint: str) -> bool:
    """Whether the endpoint binds a TCP socket that other machines can reach (a wildcard
    or a non-loopback address): then anyone who can connect reads the events."""
    if not endpoint.startswith("tcp://") or not _binds(endpoint):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return host not in ("127.0.0.1", "localhost", "::1")


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local transport, connect to anything else."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )
