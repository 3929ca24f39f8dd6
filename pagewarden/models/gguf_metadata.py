"""Read a GGUF file's key-value metadata, fast and with size limits.

`gguf.GGUFReader` builds a numpy view per array element: reading a 262k-token vocabulary
(Gemma 3) takes about a minute. This reader walks the metadata section once with
`struct` and `numpy.frombuffer` (about a second for the same file) and never touches
the tensor data. Layout (GGUF v2/v3, little-endian)::

    "GGUF" | u32 version | u64 n_tensors | u64 n_kv | n_kv x (string key, u32 type, value)
    string = u64 length + UTF-8 bytes;  array = u32 item type + u64 count + items
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

#: GGUF value type -> (struct format, numpy dtype) of the scalar types.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9
_MAX_KV = 1 << 16  # metadata entries
_MAX_ARRAY = 1 << 24  # items in one array (vocabularies are < 1M)
_MAX_STRING = 1 << 26  # bytes in one string (chat templates are KBs)


class GGUFMetadataError(ValueError):
    """The file is not a GGUF this reader understands, or its metadata is corrupt."""


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > _MAX_STRING or self.pos + n > len(self.buf):
            raise GGUFMetadataError(f"string of {n} bytes at offset {self.pos} is out of bounds")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.unpack("<I"), self.unpack("<Q")
            if count > _MAX_ARRAY:
                raise GGUFMetadataError(f"array of {count} items exceeds {_MAX_ARRAY}")
            if itype in _SCALARS:
                dtype = np.dtype(_SCALARS[itype][1])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFMetadataError(f"array at offset {self.pos} runs past the file")
                items = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos = end
                return items
            return [self.value(itype) for _ in range(count)]
        raise GGUFMetadataError(f"unknown GGUF value type {vtype} at offset {self.pos}")


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of the GGUF at `path` -> its value (str, int, float, bool, list)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return read_metadata_section(buf, path)[0]


def read_metadata_section(buf: Any, path: str | Path) -> tuple[dict[str, Any], int]:
    """The metadata of the GGUF in `buf` (anything with the buffer protocol: an mmap, a
    numpy memmap) and the offset where its tensor infos start."""
    c = _Cursor(buf)
    try:
        if bytes(buf[:4]) != b"GGUF":
            raise GGUFMetadataError(f"{path}: not a GGUF file (bad magic)")
        c.pos = 4
        version = c.unpack("<I")
        if version not in (2, 3):
            raise GGUFMetadataError(f"{path}: GGUF version {version} (big-endian?) unsupported")
        c.unpack("<Q")  # tensor count
        n_kv = c.unpack("<Q")
        if n_kv > _MAX_KV:
            raise GGUFMetadataError(f"{path}: {n_kv} metadata entries exceeds {_MAX_KV}")
        out: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            out[key] = c.value(c.unpack("<I"))
        return out, c.pos
    except struct.error as e:
        raise GGUFMetadataError(f"{path}: metadata truncated ({e})") from e
