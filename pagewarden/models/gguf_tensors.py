"""Open a GGUF for its tensors: `gguf.GGUFReader`'s tensor table and data views, with the
metadata read by `gguf_metadata.read_metadata_section` instead of the reader's own walk.

`GGUFReader` builds a numpy view per element of every metadata array; on Gemma 3's
262k-token vocabulary that walk alone takes about a minute, and the loader only needs
the values. `open_gguf` lets the reader do everything else (tensor infos, alignment,
the typed views of the tensor data that `gguf.quants.dequantize` reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField

from pagewarden.models.gguf_metadata import read_metadata_section


class _TensorReader(GGUFReader):
    """A `GGUFReader` whose `fields` hold only `general.alignment` (what the reader
    itself reads back); the metadata is in `metadata`."""

    metadata: dict[str, Any]

    def _build_fields(self, offs: int, count: int) -> int:
        self.metadata, end = read_metadata_section(self.data, self.data.filename or "GGUF")
        align = self.metadata.get("general.alignment")
        if align is not None:
            if not isinstance(align, int) or isinstance(align, bool):
                raise ValueError(f"general.alignment is {align!r}, not an integer")
            part = np.array([align], dtype=np.uint32)
            field = ReaderField(offs, "general.alignment", [part], [0], [GGUFValueType.UINT32])
            self.fields["general.alignment"] = field
        return end


def open_gguf(path: str | Path) -> tuple[dict[str, Any], GGUFReader]:
    """The GGUF's metadata (key -> str, int, float, bool or list) and a reader of its
    tensors (`reader.tensors`, `reader.data`). Raises ValueError (`GGUFMetadataError`
    among them) on a file that is not a readable GGUF."""
    reader = _TensorReader(str(path))
    return reader.metadata, reader
