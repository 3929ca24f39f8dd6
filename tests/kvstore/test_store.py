"""TierStore with in-memory tiers: verified loads, rejections, failing tiers, a full queue."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from pagewarden.kv.prefix_hash import hash_and_pack_block
from pagewarden.kvstore.checksum import block_checksum
from pagewarden.kvstore.format import (
    BlockIdentity,
    KVLayout,
    ModelFingerprint,
    Namespace,
    encode_entry,
)
from pagewarden.kvstore.keys import block_key
from pagewarden.kvstore.store import WRITER_NICENESS, Offload, TierStore
from pagewarden.kvstore.tier import TierError

LAYOUT = KVLayout(block_size=4, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
NS = Namespace(ModelFingerprint("A", "c", "w", "float32"), LAYOUT)
OTHER_MODEL = Namespace(ModelFingerprint("A", "c", "w2", "float32"), LAYOUT)


class MemTier:
    def __init__(self, name: str) -> None:
        self.name = name
        self.data: dict[str, bytes] = {}
        self.fail = False
        self.gate: threading.Event | None = None

    def get(self, key):
        if self.fail:
            raise TierError("down")
        return self.data.get(key)

    def put(self, key, data):
        if self.gate is not None:
            self.gate.wait()
        if self.fail:
            raise TierError("down")
        if key in self.data:
            return False
        self.data[key] = data
        return True

    def delete(self, key):
        self.data.pop(key, None)

    def bytes_used(self):
        return sum(map(len, self.data.values()))

    def close(self):
        pass


def _chain(n: int, start: int = 0) -> tuple[list[BlockIdentity], list[bytes]]:
    idents, payloads, parent = [], [], None
    rng = np.random.default_rng(start)
    for i in range(n):
        h, packed = hash_and_pack_block(parent, [start + 4 * i + k for k in range(4)], b"")
        idents.append(BlockIdentity(h, parent, packed))
        payloads.append(rng.standard_normal(32).astype(np.float32).tobytes())
        parent = h
    return idents, payloads


def _put(tier: MemTier, ns: Namespace, ident: BlockIdentity, payload: bytes) -> str:
    key = block_key(ns, ident.block_hash)
    tier.data[key] = encode_entry(ns, ident, block_checksum(payload, 1, 4), payload)
    return key


def test_offload_then_load_the_longest_prefix():
    disk = MemTier("disk")
    store = TierStore(NS, [disk])
    idents, payloads = _chain(4)
    store.offer([Offload(i, p, None) for i, p in zip(idents[:3], payloads[:3])])
    assert store.flush()
    assert store.counters.stores["disk"] == 3
    got = store.load(idents)
    assert [b.payload for b in got] == payloads[:3]
    assert store.counters.hits["disk"] == 3 and store.counters.misses == 1
    assert store.counters.load_count == 3 and sum(store.counters.load_buckets) == 3
    store.close()


def test_a_block_whose_seal_does_not_match_is_not_stored():
    disk = MemTier("disk")
    store = TierStore(NS, [disk])
    (ident,), (payload,) = _chain(1)
    wrong = block_checksum(payload, 1, 4) ^ 1
    store.offer([Offload(ident, payload, wrong)])
    assert store.flush()
    assert not disk.data and store.counters.offload_unverified == 1
    store.close()


def test_rejected_entries_are_deleted_and_the_next_tier_tried():
    disk, redis = MemTier("disk"), MemTier("redis")
    store = TierStore(NS, [disk, redis])
    idents, payloads = _chain(2)
    bad_key = _put(disk, OTHER_MODEL, idents[0], payloads[0])  # another model's entry...
    disk.data[block_key(NS, idents[0].block_hash)] = disk.data.pop(bad_key)  # ...under our key
    _put(redis, NS, idents[0], payloads[0])
    got = store.load(idents)
    assert len(got) == 1 and got[0].tier == "redis"
    assert store.counters.rejected == {("disk", "model"): 1}
    assert block_key(NS, idents[0].block_hash) not in disk.data  # deleted
    store.close()


def test_cross_wired_values_are_rejected():
    disk = MemTier("disk")
    store = TierStore(NS, [disk])
    idents, payloads = _chain(2)
    k0 = _put(disk, NS, idents[0], payloads[0])
    k1 = _put(disk, NS, idents[1], payloads[1])
    disk.data[k0], disk.data[k1] = disk.data[k1], disk.data[k0]
    assert store.load(idents) == []
    assert store.counters.rejected == {("disk", "key"): 1}
    store.close()


def test_a_failing_tier_is_a_miss_and_is_skipped_for_a_while():
    disk = MemTier("disk")
    disk.fail = True
    store = TierStore(NS, [disk])
    idents, payloads = _chain(1)
    assert store.load(idents) == []
    assert store.counters.errors["disk"] == 1
    disk.fail = False
    _put(disk, NS, idents[0], payloads[0])
    assert store.load(idents) == []  # still backing off: not even asked
    assert store.counters.errors["disk"] == 1
    store._down_until.clear()
    assert len(store.load(idents)) == 1
    store.close()


def test_a_full_queue_drops_blocks_and_counts_them():
    disk = MemTier("disk")
    disk.gate = threading.Event()  # the writer blocks on its first put
    store = TierStore(NS, [disk], queue_size=2)
    idents, payloads = _chain(6)
    store.offer([Offload(i, p, None) for i, p in zip(idents, payloads)])
    assert store.counters.offload_dropped >= 3
    disk.gate.set()
    assert store.flush()
    assert store.counters.stores["disk"] + store.counters.offload_dropped == 6
    store.close()


def test_tier_stores_and_drops_are_kv_events_with_their_medium():
    from pagewarden.engine.kv_events import external_hash, wire_events

    disk = MemTier("disk")
    store = TierStore(NS, [disk])
    idents, payloads = _chain(2)
    store.offer([Offload(i, p, None) for i, p in zip(idents, payloads)])
    assert store.flush()
    key = block_key(NS, idents[0].block_hash)
    disk.data[key] = disk.data[key][:-1]  # damaged: rejected and dropped on load
    assert store.load(idents) == []
    wire = wire_events(store.take_events(), 4)
    assert wire[0][0] == "BlockStored" and wire[0][6] == "DISK"
    assert wire[0][1] == [external_hash(i.block_hash) for i in idents]  # one chain, one event
    assert wire[0][3] == list(range(8))
    assert wire[1] == ["BlockRemoved", [external_hash(idents[0].block_hash)], "DISK"]
    assert store.take_events() == []
    store.close()


def test_the_writer_thread_runs_nicer_than_the_engine():
    store = TierStore(NS, [MemTier("disk")])
    try:
        for _ in range(100):  # the thread sets its own priority when it starts
            tid = store._writer.native_id
            if tid is not None and os.getpriority(os.PRIO_PROCESS, tid) > os.getpriority(
                os.PRIO_PROCESS, 0
            ):
                break
            time.sleep(0.01)
        engine_nice = os.getpriority(os.PRIO_PROCESS, 0)
        want = min(engine_nice + WRITER_NICENESS, 19)
        assert os.getpriority(os.PRIO_PROCESS, store._writer.native_id) == want
    finally:
        store.close()
