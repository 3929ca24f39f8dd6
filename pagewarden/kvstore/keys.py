"""Tier keys: a stable hash seeded by us, namespaced by model fingerprint and KV layout.

``key = blake2b-256(person="pw-kvtier-key1", namespace digest || block chain hash)``, as
hex, behind a readable namespace prefix. The chain hash is already blake2b over the
parent hash, the extra keys and the tokens (``kv/prefix_hash.py``); nothing depends on
Python's ``hash()`` or its per-process seed, so every process derives the same key.
"""

from __future__ import annotations

from hashlib import blake2b

from pagewarden.kv.block import BlockHash
from pagewarden.kvstore.format import FORMAT_VERSION, Namespace


def namespace_prefix(ns: Namespace) -> str:
    """``v<format>-<model 16 hex>-<layout 8 hex>``: a directory name, a Redis key prefix."""
    layout = blake2b(ns.layout.encode(), digest_size=4).hexdigest()
    return f"v{FORMAT_VERSION}-{ns.model_digest.hex()[:16]}-{layout}"


def block_key(ns: Namespace, block_hash: BlockHash) -> str:
    """The 64-hex key of a block in ``ns``."""
    h = blake2b(digest_size=32, person=b"pw-kvtier-key1")
    h.update(ns.digest)
    h.update(block_hash)
    return h.hexdigest()
