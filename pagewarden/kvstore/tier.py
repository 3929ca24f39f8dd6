"""What every KV tier implements, the registry of tiers, and their errors."""

from __future__ import annotations

import re
from typing import Protocol


class TierError(Exception):
    """A tier failed or timed out (disk full, permission denied, Redis down): the load or
    store it was doing counts as a miss; serving goes on."""


class KVTier(Protocol):
    """A key -> bytes store for tier entries. Keys are 64-hex ``keys.block_key`` values.

    Every method may raise ``TierError``; none may raise anything else for I/O trouble.
    Values are opaque here: ``format.decode_entry`` verifies what ``get`` returns.
    """

    name: str

    def get(self, key: str) -> bytes | None:
        """The stored bytes, or None when the key is absent."""
        ...

    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key``; False when an entry was already there."""
        ...

    def delete(self, key: str) -> None:
        """Remove the entry (a rejected one); absent keys are fine."""
        ...

    def bytes_used(self) -> int:
        """Bytes this tier holds (as far as this process knows)."""
        ...

    def close(self) -> None: ...


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like ``"20GiB"``, ``"512MB"``; ``ValueError`` otherwise."""
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{value!r} is not a size; use bytes or e.g. '20GiB', '512MB'")
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"a tier size must be positive, got {value!r}")
    return size


def check_tier_options(
    offload_dir: str | None,
    dir_size: int | str,
    redis_url: str | None,
    redis_size: int | str,
    redis_ttl: int,
    timeout_s: float,
    prefix_caching: bool,
) -> None:
    """``ValueError`` naming the first bad KV tier option."""
    if offload_dir is None and redis_url is None:
        return
    if not prefix_caching:
        raise ValueError("KV tiers (kv_offload_dir / kv_offload_redis) need prefix caching on")
    parse_size(dir_size)
    parse_size(redis_size)
    if redis_url is not None and not redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"kv_offload_redis must be a redis:// URL, got {redis_url!r}")
    if not redis_ttl > 0 or not timeout_s > 0:
        raise ValueError("kv_offload_redis_ttl and kv_offload_timeout must be > 0")
