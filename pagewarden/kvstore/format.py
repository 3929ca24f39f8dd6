"""The stored block format (version 1) and its verification.

An entry is one sealed block, self-describing::

    offset  size  field
    0       8     magic b"PWKVBLK\\0"
    8       2     format version (1), little-endian like every integer below
    10      2     reserved (0)
    12      4     header length H (bytes before the payload)
    16      32    model fingerprint digest (architecture, config, weights as loaded, dtype)
    48      80    KV layout: block_size, num_layers, num_kv_heads, head_dim (u32 each),
                  dtype, K/V order, tag scheme, checksum scheme (16-byte ASCII each)
    128     32    the block's chain hash (kv/prefix_hash.py)
    160     1     1 if the block has a parent, else 0
    161     32    the parent's chain hash (zeros at the root)
    193     4     token count n (== block_size)
    197     4n    the block's token ids, uint32
    ...     8     content checksum (worker/integrity.py's block checksum, unsigned)
    ...     8     payload length P
    ...     16    blake2b-128 of every header byte before it
    H       P     payload: (num_layers, 2, block_size, num_kv_heads, head_dim) in dtype

``decode_entry`` checks, in this order, and raises ``EntryRejected(reason)`` at the first
mismatch: length, magic, version, header digest, model, layout, the block's own hash, its
parent, its token ids against the requesting chain's, the payload length, and the
checksum recomputed over the payload. Nothing is trusted from the entry that the reader
did not compare with what it asked for; the worker then recomputes the checksum again
over the bytes as they land in the pool.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from hashlib import blake2b

from pagewarden.kv.block import BlockHash
from pagewarden.kvstore.checksum import block_checksum

FORMAT_VERSION = 1
MAGIC = b"PWKVBLK\x00"
_PREFIX = struct.Struct("<8sHHI")  # magic, version, reserved, header length
_LAYOUT = struct.Struct("<IIII16s16s16s16s")
_IDENTITY = struct.Struct("<32sB32sI")  # block hash, has parent, parent, token count
_TRAILER = struct.Struct("<QQ")  # checksum, payload length
_DIGEST_BYTES = 16
_FIXED = _PREFIX.size + 32 + _LAYOUT.size + _IDENTITY.size + _TRAILER.size + _DIGEST_BYTES

#: Bytes per element of the KV dtypes a tier stores.
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: The payload's dimension order (kv_store.py's per-layer cache, one block, layers stacked).
KV_ORDER = "L,KV,slot,head,d"
TAG_SCHEME = "mix64-chain-1"  # worker/integrity.py: tag_p = mix64(tag_{p-1}, token, p)
CHECKSUM_SCHEME = "mlin32-1"  # worker/integrity.py: multilinear over 32-bit limbs


class RejectReason(str, enum.Enum):
    """Why a stored entry was not used (the ``reason`` label of the rejection counter)."""

    TRUNCATED = "truncated"
    MAGIC = "magic"
    VERSION = "version"
    HEADER = "header"
    MODEL = "model"
    LAYOUT = "layout"
    KEY = "key"
    PARENT = "parent"
    TOKENS = "tokens"
    SIZE = "size"
    CHECKSUM = "checksum"
    POOL_CHECKSUM = "pool_checksum"  # the bytes that landed in the pool did not verify


class EntryRejected(Exception):
    """A stored entry failed verification: treat it as a miss and delete it."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


def _ascii16(value: str) -> bytes:
    raw = value.encode("ascii")
    if len(raw) > 16:
        raise ValueError(f"{value!r} is longer than 16 ASCII bytes")
    return raw.ljust(16, b"\x00")


@dataclass(frozen=True)
class KVLayout:
    """How a block's K/V bytes are laid out; an entry must match it field for field."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_order: str = KV_ORDER
    tag_scheme: str = TAG_SCHEME
    checksum_scheme: str = CHECKSUM_SCHEME

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"KV dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def payload_bytes(self) -> int:
        """Bytes of one block's K and V across all layers."""
        return (
            self.num_layers
            * 2
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * DTYPE_SIZES[self.dtype]
        )

    def encode(self) -> bytes:
        return _LAYOUT.pack(
            self.block_size,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            _ascii16(self.dtype),
            _ascii16(self.kv_order),
            _ascii16(self.tag_scheme),
            _ascii16(self.checksum_scheme),
        )

    @classmethod
    def decode(cls, raw: bytes) -> tuple[int, int, int, int, str, str, str, str]:
        """The raw fields (no validation: a foreign layout is compared, not built)."""
        bs, layers, heads, dim, *names = _LAYOUT.unpack(raw)
        text = [n.rstrip(b"\x00").decode("ascii", "replace") for n in names]
        return (bs, layers, heads, dim, text[0], text[1], text[2], text[3])

    def fields(self) -> tuple[int, int, int, int, str, str, str, str]:
        return (
            self.block_size,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.kv_order,
            self.tag_scheme,
            self.checksum_scheme,
        )


@dataclass(frozen=True)
class ModelFingerprint:
    """What makes K/V of one model differ from another's with the same layout."""

    architecture: str
    config_digest: str  # hex blake2b of the model config, canonical JSON
    weights_digest: str  # hex blake2b of every weight tensor as loaded
    dtype: str

    @property
    def digest(self) -> bytes:
        h = blake2b(digest_size=32, person=b"pw-model-fp1")
        for part in (self.architecture, self.config_digest, self.weights_digest, self.dtype):
            raw = part.encode("utf-8")
            h.update(struct.pack("<I", len(raw)))
            h.update(raw)
        return h.digest()


def config_digest(config: dict) -> str:
    """Hex digest of a model config (canonical JSON: sorted keys, no whitespace)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return blake2b(text.encode("utf-8"), digest_size=32).hexdigest()


@dataclass(frozen=True)
class Namespace:
    """A model and a KV layout: entries of one namespace never serve another."""

    fingerprint: ModelFingerprint
    layout: KVLayout

    @property
    def model_digest(self) -> bytes:
        return self.fingerprint.digest

    @property
    def digest(self) -> bytes:
        h = blake2b(digest_size=32, person=b"pw-kv-ns1")
        h.update(self.fingerprint.digest)
        h.update(self.layout.encode())
        return h.digest()

    @property
    def entry_bytes(self) -> int:
        """The exact size of an entry in this namespace."""
        return _FIXED + 4 * self.layout.block_size + self.layout.payload_bytes


@dataclass(frozen=True)
class BlockIdentity:
    """What the requesting chain says a block is: compared with every entry it loads."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_bytes: bytes  # kv/prefix_hash.pack_block_tokens of the block's tokens


@dataclass(frozen=True)
class VerifiedBlock:
    """An entry that passed every check: its payload and the checksum it carries."""

    payload: memoryview
    checksum: int  # unsigned 64-bit


def encode_entry(
    ns: Namespace, ident: BlockIdentity, checksum: int, payload: bytes | memoryview
) -> bytes:
    """One entry's bytes; ``checksum`` is the block checksum of ``payload`` (unsigned)."""
    layout = ns.layout
    if len(payload) != layout.payload_bytes:
        raise ValueError(f"payload has {len(payload)} bytes, the layout {layout.payload_bytes}")
    if len(ident.token_bytes) != 4 * layout.block_size:
        raise ValueError("a stored block holds exactly block_size tokens")
    n = layout.block_size
    header_len = _FIXED + 4 * n
    parts = [
        _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, header_len),
        ns.model_digest,
        layout.encode(),
        _IDENTITY.pack(
            ident.block_hash,
            ident.parent_hash is not None,
            ident.parent_hash or b"\x00" * 32,
            n,
        ),
        ident.token_bytes,
        _TRAILER.pack(checksum, len(payload)),
    ]
    head = b"".join(parts)
    return head + blake2b(head, digest_size=_DIGEST_BYTES).digest() + bytes(payload)


def decode_entry(data: bytes, ns: Namespace, want: BlockIdentity) -> VerifiedBlock:
    """Verify ``data`` as the entry of ``want`` in ``ns``; ``EntryRejected`` otherwise."""
    layout = ns.layout
    if len(data) < _FIXED:
        raise EntryRejected(RejectReason.TRUNCATED, f"{len(data)} bytes, shorter than a header")
    magic, version, _, header_len = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise EntryRejected(RejectReason.MAGIC, "not a pagewarden KV block")
    if version != FORMAT_VERSION:
        raise EntryRejected(RejectReason.VERSION, f"format version {version}, not {FORMAT_VERSION}")
    if header_len < _FIXED or header_len > len(data):
        raise EntryRejected(
            RejectReason.TRUNCATED, f"header of {header_len} bytes in {len(data)} bytes"
        )
    head_end = header_len - _DIGEST_BYTES
    view = memoryview(data)
    if blake2b(view[:head_end], digest_size=_DIGEST_BYTES).digest() != view[head_end:header_len]:
        raise EntryRejected(RejectReason.HEADER, "header digest does not match its bytes")
    off = _PREFIX.size
    if view[off : off + 32] != ns.model_digest:
        raise EntryRejected(RejectReason.MODEL, "written by another model (or weights, dtype)")
    off += 32
    theirs = KVLayout.decode(bytes(view[off : off + _LAYOUT.size]))
    if theirs != layout.fields():
        raise EntryRejected(RejectReason.LAYOUT, f"layout {theirs}, expected {layout.fields()}")
    off += _LAYOUT.size
    block_hash, has_parent, parent, n = _IDENTITY.unpack_from(data, off)
    off += _IDENTITY.size
    if block_hash != want.block_hash:
        raise EntryRejected(RejectReason.KEY, "entry holds another block (swapped or cross-wired)")
    if (parent if has_parent else None) != want.parent_hash:
        raise EntryRejected(RejectReason.PARENT, "parent chain hash differs from the requester's")
    if n != layout.block_size or header_len != _FIXED + 4 * n:
        raise EntryRejected(
            RejectReason.TOKENS, f"{n} tokens, the layout's block holds {layout.block_size}"
        )
    if view[off : off + 4 * n] != want.token_bytes:
        raise EntryRejected(RejectReason.TOKENS, "token ids differ from the requesting chain's")
    off += 4 * n
    checksum, payload_len = _TRAILER.unpack_from(data, off)
    if payload_len != layout.payload_bytes or len(data) != header_len + payload_len:
        raise EntryRejected(
            RejectReason.SIZE,
            f"payload of {len(data) - header_len} bytes (header says {payload_len}), "
            f"the layout needs {layout.payload_bytes}",
        )
    payload = view[header_len:]
    if block_checksum(payload, layout.num_layers, layout.block_size) != checksum:
        raise EntryRejected(RejectReason.CHECKSUM, "payload does not match its checksum")
    return VerifiedBlock(payload, checksum)
