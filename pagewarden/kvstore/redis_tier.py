"""The Redis tier: entries as Redis strings under ``pagewarden:kv:<namespace>:<key>``.

Several engines (Ray replicas included) share one server. ``SET NX`` stores an entry only
if no other engine has (the bytes would be the same), with a TTL so a model that is no
longer served does not hold memory forever. The server's own ``maxmemory`` with an
``allkeys-lru`` policy bounds the whole store; ``max_bytes`` additionally bounds what
this engine wrote (its oldest entries are deleted first). Every call runs with a socket
timeout: a slow or dead server is a ``TierError`` (a miss), never a stalled step for
longer than the timeout.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from pagewarden.kvstore.tier import TierError


class RedisTier:
    """KV tier entries in a Redis server (see the module docstring)."""

    name = "redis"

    def __init__(
        self,
        url: str,
        namespace: str,
        max_bytes: int,
        ttl_s: int = 86400,
        timeout_s: float = 0.5,
    ) -> None:
        try:
            import redis
        except ImportError as e:  # pragma: no cover - the kv-redis extra is missing
            raise TierError(
                "the Redis KV tier needs the redis client: pip install 'pagewarden[kv-redis]'"
            ) from e
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.prefix = f"pagewarden:kv:{namespace}:"
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._mine: OrderedDict[str, int] = OrderedDict()  # keys this engine wrote
        self._bytes = 0

    def get(self, key: str) -> bytes | None:
        try:
            value = self.client.get(self.prefix + key)
        except self._errors as e:
            raise TierError(f"redis GET: {e}") from e
        if value is not None and not isinstance(value, bytes):
            raise TierError(f"redis GET returned {type(value).__name__}, not bytes")
        return value

    def put(self, key: str, data: bytes) -> bool:
        try:
            stored = self.client.set(self.prefix + key, data, nx=True, ex=self.ttl_s)
        except self._errors as e:
            raise TierError(f"redis SET: {e}") from e
        if not stored:
            return False
        evict: list[str] = []
        with self._lock:
            self._mine[key] = len(data)
            self._bytes += len(data)
            while self._bytes > self.max_bytes and self._mine:
                old, size = self._mine.popitem(last=False)
                self._bytes -= size
                evict.append(self.prefix + old)
        if evict:
            try:
                self.client.delete(*evict)
            except self._errors as e:
                raise TierError(f"redis DEL: {e}") from e
        return True

    def delete(self, key: str) -> None:
        with self._lock:
            size = self._mine.pop(key, None)
            if size is not None:
                self._bytes -= size
        try:
            self.client.delete(self.prefix + key)
        except self._errors as e:
            raise TierError(f"redis DEL: {e}") from e

    def bytes_used(self) -> int:
        return self._bytes

    def close(self) -> None:
        try:
            self.client.close()
        except self._errors:
            pass
