"""Chained content hashes over full blocks, for prefix caching.

::

    h_0 = H(ROOT,  tokens[0:bs],   extra_keys)
    h_1 = H(h_0,   tokens[bs:2bs], extra_keys)      a hit on h_1 implies the whole prefix

H is blake2b-256 over a canonical byte encoding: the 32-byte parent, the tagged extra
keys (self-delimiting), then the tokens as little-endian uint32 (so parent, keys and a
16-token block fit one 128-byte compression block). A hit is still confirmed
by an exact token compare (``KVBlock.token_bytes``), so a collision can never serve KV.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from hashlib import blake2b

from pagewarden.kv.block import BlockHash

_PERSON = b"pagewarden-kv1"
_ROOT = b"\x00" * 32


class ExtraKeyKind(enum.IntEnum):
    """Tags that keep extra keys of different kinds from ever colliding."""

    CACHE_SALT = 1
    MODEL_ID = 2
    ADAPTER = 3
    ROPE = 4  # a RoPE variant other than the model's first (Phi-3 longrope's "long")


_extra_cache: dict[tuple[str | None, str | None, str | None, str | None], bytes] = {}


def encode_extra_keys(
    model_id: str | None = None,
    cache_salt: str | None = None,
    adapter: str | None = None,
    rope: str | None = None,
) -> bytes:
    """Canonical bytes for a request's extra keys: count, then (tag, length, utf-8) each.

    ``None`` omits a key; ``""`` is a present, empty key (so they differ).
    """
    key = (model_id, cache_salt, adapter, rope)
    cached = _extra_cache.get(key)
    if cached is not None:
        return cached
    items = [
        (kind, value)
        for kind, value in (
            (ExtraKeyKind.CACHE_SALT, cache_salt),
            (ExtraKeyKind.MODEL_ID, model_id),
            (ExtraKeyKind.ADAPTER, adapter),
            (ExtraKeyKind.ROPE, rope),
        )
        if value is not None
    ]
    parts = [struct.pack("<I", len(items))]
    for kind, value in items:
        raw = value.encode("utf-8")
        parts.append(struct.pack("<BI", int(kind), len(raw)))
        parts.append(raw)
    out = b"".join(parts)
    if len(_extra_cache) < 4096:
        _extra_cache[key] = out
    return out


#: Compiled ``<{n}I`` packers by token count (one per block size in practice).
_token_packers: dict[int, struct.Struct] = {}

#: An empty blake2b-256 hasher with the person string set. ``copy()`` of it gives the
#: same digests as a new ``blake2b(..., digest_size=32, person=_PERSON)`` for less than
#: half the cost (no keyword parsing, no parameter block); a prefix lookup or seal hashes
#: once per block.
_EMPTY_HASHER = blake2b(digest_size=32, person=_PERSON)


def _token_packer(n: int) -> struct.Struct:
    packer = _token_packers.get(n)
    if packer is None:
        packer = _token_packers[n] = struct.Struct(f"<{n}I")
    return packer


def pack_block_tokens(token_ids: Sequence[int]) -> bytes:
    """The canonical encoding of a block's tokens: little-endian uint32 each. Token ids
    must be in ``[0, 2**32)`` (``ValueError`` otherwise). Blocks keep it for the exact
    compare on a prefix hit."""
    packer = _token_packers.get(len(token_ids)) or _token_packer(len(token_ids))
    try:
        return packer.pack(*token_ids)
    except struct.error:
        raise _bad_token_ids(token_ids) from None


def _bad_token_ids(token_ids: Sequence[int]) -> ValueError:
    bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < 1 << 32)]
    return ValueError(f"token ids must be ints in [0, 2**32), got {bad[:4]}")


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes
) -> BlockHash:
    """``H(parent, token_ids, extra_keys)`` for one full block; token ids must be in
    ``[0, 2**32)`` (``ValueError`` otherwise)."""
    return hash_and_pack_block(parent, token_ids, extra_keys)[0]


def hash_and_pack_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes
) -> tuple[BlockHash, bytes]:
    """``(hash_block_tokens(...), pack_block_tokens(token_ids))`` in one pass."""
    packer = _token_packers.get(len(token_ids)) or _token_packer(len(token_ids))
    try:  # pack_block_tokens, inlined: a prefix lookup or seal runs this once per block
        packed = packer.pack(*token_ids)
    except struct.error:
        raise _bad_token_ids(token_ids) from None
    h = _EMPTY_HASHER.copy()
    h.update(parent if parent is not None else _ROOT)
    h.update(extra_keys)
    h.update(packed)
    # The digest is the BlockHash; calling the NewType would cost a Python-level call.
    return h.digest(), packed  # type: ignore[return-value]


def hash_block_chain(
    token_ids: Sequence[int], block_size: int, extra_keys: bytes, num_blocks: int | None = None
) -> list[BlockHash]:
    """Hashes of the first ``num_blocks`` full blocks of ``token_ids`` (all full ones if None)."""
    n = len(token_ids) // block_size if num_blocks is None else num_blocks
    out: list[BlockHash] = []
    parent: BlockHash | None = None
    for i in range(n):
        parent = hash_block_tokens(
            parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys
        )
        out.append(parent)
    return out
