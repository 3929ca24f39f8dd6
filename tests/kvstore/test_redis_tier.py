"""The Redis tier against a real redis-server: sharing, size, a dead server is a miss."""

from __future__ import annotations

import socket
import threading

import pytest

from pagewarden.kvstore.tier import TierError

redis = pytest.importorskip("redis")

from pagewarden.kvstore.redis_tier import RedisTier  # noqa: E402


def _key(i: int) -> str:
    return f"{i:064x}"


def test_two_clients_share_entries(redis_server):
    a = RedisTier(redis_server.url, "ns", 10**6)
    b = RedisTier(redis_server.url, "ns", 10**6)
    other_ns = RedisTier(redis_server.url, "ns2", 10**6)
    assert a.put(_key(1), b"v1") is True
    assert b.put(_key(1), b"v1") is False  # SET NX: the first writer's entry stays
    assert b.get(_key(1)) == b"v1"
    assert other_ns.get(_key(1)) is None  # namespaced
    ttl = redis.Redis.from_url(redis_server.url).ttl("pagewarden:kv:ns:" + _key(1))
    assert 0 < ttl <= 86400
    b.delete(_key(1))
    assert a.get(_key(1)) is None


def test_this_engines_size_bound(redis_server):
    t = RedisTier(redis_server.url, "ns", 250)
    for i in range(4):
        t.put(_key(i), bytes([i]) * 100)
    assert t.get(_key(0)) is None and t.get(_key(1)) is None
    assert t.get(_key(2)) is not None and t.get(_key(3)) is not None
    assert t.bytes_used() == 200


def test_a_dead_or_hanging_server_is_a_tier_error_within_the_timeout(redis_server):
    t = RedisTier(redis_server.url, "ns", 10**6, timeout_s=0.3)
    t.put(_key(1), b"x")
    redis_server.stop()
    with pytest.raises(TierError):
        t.get(_key(1))
    with pytest.raises(TierError):
        t.put(_key(2), b"x")
    # A server that accepts connections and never answers: the timeout, not a hang.
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port = lsock.getsockname()[1]
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(lsock.accept()[0]), daemon=True).start()
    hang = RedisTier(f"redis://127.0.0.1:{port}/0", "ns", 10**6, timeout_s=0.3)
    import time

    start = time.monotonic()
    with pytest.raises(TierError):
        hang.get(_key(1))
    assert time.monotonic() - start < 2.0
    lsock.close()
    for s in held:
        s.close()
