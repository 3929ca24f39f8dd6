"""The stored block format: every field mismatch and a flipped bit is rejected with its reason."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch

from pagewarden.kv.prefix_hash import hash_and_pack_block
from pagewarden.kvstore.checksum import block_checksum, to_unsigned64
from pagewarden.kvstore.format import (
    BlockIdentity,
    EntryRejected,
    KVLayout,
    ModelFingerprint,
    Namespace,
    RejectReason,
    decode_entry,
    encode_entry,
)
from pagewarden.kvstore.keys import block_key, namespace_prefix
from pagewarden.worker.integrity import block_checksums

LAYOUT = KVLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
FP = ModelFingerprint("LlamaForCausalLM", "c" * 64, "w" * 64, "bfloat16")
NS = Namespace(FP, LAYOUT)


def _block(tokens: list[int], parent=None, seed: int = 0):
    h, packed = hash_and_pack_block(parent, tokens, b"\x00\x00\x00\x00")
    rng = np.random.default_rng(seed)
    payload = rng.integers(0, 256, LAYOUT.payload_bytes, dtype=np.uint8).tobytes()
    checksum = block_checksum(payload, LAYOUT.num_layers, LAYOUT.block_size)
    return BlockIdentity(h, parent, packed), checksum, payload


def _entry(tokens=(1, 2, 3, 4), parent=None, seed=0, ns=NS):
    ident, checksum, payload = _block(list(tokens), parent, seed)
    return ident, encode_entry(ns, ident, checksum, payload), payload


def _reject(data: bytes, want: BlockIdentity, ns: Namespace = NS) -> RejectReason:
    with pytest.raises(EntryRejected) as info:
        decode_entry(data, ns, want)
    return info.value.reason


def test_round_trip_returns_the_payload_and_its_checksum():
    ident, data, payload = _entry()
    got = decode_entry(data, NS, ident)
    assert bytes(got.payload) == payload
    assert got.checksum == block_checksum(payload, 2, 4)
    assert len(data) == NS.entry_bytes


def test_numpy_checksum_equals_the_pools_block_checksum():
    torch.manual_seed(0)
    caches = [torch.randn(2, 5, 4, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    for b in (1, 3):
        payload = torch.stack([c[:, b] for c in caches]).contiguous().view(torch.uint8)
        ours = block_checksum(payload.numpy().tobytes(), 2, 4)
        pools = int(block_checksums(caches, torch.tensor([b]))[0])
        assert ours == to_unsigned64(pools)


@pytest.mark.parametrize(
    "field,value,reason",
    [
        ("architecture", "Qwen2ForCausalLM", RejectReason.MODEL),
        ("config_digest", "d" * 64, RejectReason.MODEL),
        ("weights_digest", "x" * 64, RejectReason.MODEL),
        ("dtype", "float16", RejectReason.MODEL),
    ],
)
def test_another_model_is_rejected(field, value, reason):
    ident, data, _ = _entry()
    other = Namespace(dataclasses.replace(FP, **{field: value}), LAYOUT)
    assert _reject(data, ident, other) is reason


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_layers", 3),
        ("num_kv_heads", 1),
        ("head_dim", 16),
        ("dtype", "float16"),
        ("kv_order", "KV,L,slot,head,d"),
        ("tag_scheme", "other-tags"),
        ("checksum_scheme", "crc32"),
    ],
)
def test_another_layout_is_rejected(field, value):
    ident, data, _ = _entry()
    other = Namespace(FP, dataclasses.replace(LAYOUT, **{field: value}))
    assert _reject(data, ident, other) is RejectReason.LAYOUT


def test_another_block_size_is_rejected_as_a_layout():
    ident, data, _ = _entry()
    other = Namespace(FP, dataclasses.replace(LAYOUT, block_size=8))
    assert _reject(data, ident, other) is RejectReason.LAYOUT


def test_identity_mismatches():
    ident, data, _ = _entry()
    other, _, _ = _block([1, 2, 3, 5])
    assert _reject(data, other) is RejectReason.KEY  # a swapped / cross-wired entry
    parent_ident, _, _ = _block([9, 9, 9, 9])
    child_ident, child_data, _ = _entry(parent=parent_ident.block_hash)
    assert decode_entry(child_data, NS, child_ident)
    assert _reject(child_data, dataclasses.replace(child_ident, parent_hash=None)) is (
        RejectReason.PARENT
    )
    wrong_tokens = dataclasses.replace(ident, token_bytes=struct.pack("<4I", 1, 2, 3, 5))
    assert _reject(data, wrong_tokens) is RejectReason.TOKENS


def test_token_ids_are_compared_even_when_the_hash_agrees():
    # A hash collision (or a forged entry that copies the hash) still serves nothing.
    ident, _, payload = _block([1, 2, 3, 4])
    forged = BlockIdentity(ident.block_hash, None, struct.pack("<4I", 7, 7, 7, 7))
    data = encode_entry(NS, forged, block_checksum(payload, 2, 4), payload)
    assert _reject(data, ident) is RejectReason.TOKENS


def test_every_flipped_bit_is_rejected():
    ident, data, _ = _entry()
    header_len = len(data) - LAYOUT.payload_bytes
    rng = np.random.default_rng(1)
    positions = list(range(0, header_len * 8, 7)) + [
        int(p) for p in rng.integers(header_len * 8, len(data) * 8, 200)
    ]
    for bit in positions:
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        reason = _reject(bytes(flipped), ident)
        if bit >= header_len * 8:
            assert reason is RejectReason.CHECKSUM, bit
        else:
            assert reason in {
                RejectReason.MAGIC,
                RejectReason.VERSION,
                RejectReason.TRUNCATED,
                RejectReason.HEADER,
            }, (bit, reason)


def test_truncated_and_padded_entries():
    ident, data, _ = _entry()
    assert _reject(data[:10], ident) is RejectReason.TRUNCATED
    assert _reject(data[:-1], ident) is RejectReason.SIZE
    assert _reject(data + b"\x00", ident) is RejectReason.SIZE
    assert _reject(b"", ident) is RejectReason.TRUNCATED


def test_magic_and_version():
    ident, data, _ = _entry()
    assert _reject(b"NOTPWKV!" + data[8:], ident) is RejectReason.MAGIC
    assert _reject(data[:8] + struct.pack("<H", 2) + data[10:], ident) is RejectReason.VERSION


def test_keys_are_stable_and_namespaced():
    ident, _, _ = _entry()
    key = block_key(NS, ident.block_hash)
    # Fixed value: a key must not change between processes, runs or Python versions.
    assert key == "ee97643ead1a2f105eeb39347aa2914b7ec93563aa0afac170a1a1d3cf8847ed"
    assert len(key) == 64 and int(key, 16) >= 0
    other_model = Namespace(dataclasses.replace(FP, weights_digest="y" * 64), LAYOUT)
    other_layout = Namespace(FP, dataclasses.replace(LAYOUT, head_dim=16))
    keys = {
        key,
        block_key(other_model, ident.block_hash),
        block_key(other_layout, ident.block_hash),
    }
    assert len(keys) == 3
    assert namespace_prefix(NS) != namespace_prefix(other_model)
    assert namespace_prefix(NS).startswith("v1-")
