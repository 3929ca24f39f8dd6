"""Prefix hashes: chaining, canonical encoding, tagged extra keys."""

from __future__ import annotations

import pytest

from pagewarden.kv.prefix_hash import encode_extra_keys, hash_block_chain, hash_block_tokens


def test_hash_is_deterministic_and_chained() -> None:
    e = encode_extra_keys("m", None)
    h0 = hash_block_tokens(None, [1, 2, 3, 4], e)
    assert h0 == hash_block_tokens(None, (1, 2, 3, 4), e)
    assert len(h0) == 32
    h1 = hash_block_tokens(h0, [5, 6, 7, 8], e)
    assert h1 != hash_block_tokens(None, [5, 6, 7, 8], e)
    assert hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, e) == [h0, h1]


def test_extra_keys_isolate_salt_model_and_kind() -> None:
    tokens = [1, 2, 3, 4]
    keys = [
        encode_extra_keys(None, None),
        encode_extra_keys("a", None),
        encode_extra_keys(None, "a"),  # same string, different kind
        encode_extra_keys("", None),  # present-but-empty differs from absent
        encode_extra_keys("a", "b"),
        encode_extra_keys("b", "a"),
    ]
    assert len(set(keys)) == len(keys)
    hashes = {hash_block_tokens(None, tokens, k) for k in keys}
    assert len(hashes) == len(keys)


def test_token_encoding_is_unambiguous() -> None:
    e = encode_extra_keys()
    assert hash_block_tokens(None, [1, 256], e) != hash_block_tokens(None, [256, 1], e)
    assert hash_block_tokens(None, [0], e) != hash_block_tokens(None, [0, 0], e)


def test_hash_encoding_is_pinned() -> None:
    """The byte encoding of the docstring, spelled out: blake2b-256 (person
    b"pagewarden-kv1") over the parent (32 zero bytes for the first block), the extra
    keys, then the tokens as little-endian uint32."""
    import struct
    from hashlib import blake2b

    e = encode_extra_keys("m", "salt")
    tokens = [1, 2**31 + 5, 31999, 0]
    h0 = blake2b(
        b"\x00" * 32 + e + struct.pack("<4I", *tokens), digest_size=32, person=b"pagewarden-kv1"
    ).digest()
    assert hash_block_tokens(None, tokens, e) == h0
    h1 = blake2b(
        h0 + e + struct.pack("<2I", 5, 6), digest_size=32, person=b"pagewarden-kv1"
    ).digest()
    assert hash_block_tokens(h0, (5, 6), e) == h1


def test_token_ids_outside_uint32_are_a_clear_error() -> None:
    e = encode_extra_keys("m", None)
    for bad in ([-1, 2], [1 << 32], [1.5]):
        with pytest.raises(ValueError, match="token ids must be ints"):
            hash_block_tokens(None, bad, e)
    hash_block_tokens(None, [0, (1 << 32) - 1], e)  # the whole range is fine
