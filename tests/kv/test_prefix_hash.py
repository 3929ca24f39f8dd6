"""Prefix hashes: chaining, canonical encoding, tagged extra keys."""

from __future__ import annotations

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
