"""The disk tier: one file per block under ``DIR/<namespace>/<key[:2]>/<key>.kvb``.

Sharing and crashes:

* a writer writes a private temporary file in the target directory and renames it over
  the final name (``os.replace``, atomic on POSIX), so a reader opens either no file or
  a whole one, never a partial block; a crash leaves at most a stray ``.tmp`` file,
  removed by the next scan;
* two writers of the same block write the same bytes; whichever rename lands last wins,
  and either result verifies;
* a torn or damaged file (a crash without fsync, a bad disk, another program) fails
  ``format.decode_entry`` and is deleted; it is never served.

Size: entries are evicted least recently used first (by modification time; a hit
touches its file) when this process's view of the directory passes ``max_bytes``. The
view is rebuilt from the directory every ``rescan_every`` stores, so entries other
engines wrote count too.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

from pagewarden.kvstore.tier import TierError

_SUFFIX = ".kvb"


class DiskTier:
    """KV tier entries as files in one namespace directory (see the module docstring)."""

    name = "disk"

    def __init__(
        self, root: str | Path, namespace: str, max_bytes: int, rescan_every: int = 256
    ) -> None:
        self.dir = Path(root) / namespace
        self.max_bytes = max_bytes
        self.rescan_every = rescan_every
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # key -> size, oldest first
        self._bytes = 0
        self._stores_since_scan = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TierError(f"cannot create the KV tier directory {self.dir}: {e}") from e
        self._scan()

    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / (key + _SUFFIX)

    def _scan(self) -> None:
        """Rebuild the LRU view from the directory (stray temporary files removed)."""
        found: list[tuple[float, str, int]] = []
        for sub in self.dir.iterdir() if self.dir.is_dir() else ():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if entry.name.endswith(".tmp"):
                    if st.st_mtime < time.time() - 3600:
                        _unlink(Path(entry.path))
                elif entry.name.endswith(_SUFFIX):
                    found.append((st.st_mtime, entry.name[: -len(_SUFFIX)], st.st_size))
        found.sort()
        with self._lock:
            self._lru = OrderedDict((key, size) for _, key, size in found)
            self._bytes = sum(size for _, _, size in found)
            self._stores_since_scan = 0

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)  # most recently used
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            return None
        except OSError as e:
            raise TierError(f"reading {path}: {e}") from e
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
        return data

    def put(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if path.exists():
            return False
        tmp = path.with_name(f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: readers see no file or the whole one
        except OSError as e:
            _unlink(tmp)
            raise TierError(f"writing {path}: {e}") from e
        with self._lock:
            self._forget(key)
            self._lru[key] = len(data)
            self._bytes += len(data)
            self._stores_since_scan += 1
            rescan = self._stores_since_scan >= self.rescan_every
        if rescan:
            self._scan()
        self._evict()
        return True

    def delete(self, key: str) -> None:
        _unlink(self._path(key))
        with self._lock:
            self._forget(key)

    def _forget(self, key: str) -> None:
        size = self._lru.pop(key, None)
        if size is not None:
            self._bytes -= size

    def _evict(self) -> None:
        """Delete least recently used entries until the tier fits in ``max_bytes``."""
        while True:
            with self._lock:
                if self._bytes <= self.max_bytes or not self._lru:
                    return
                key, size = self._lru.popitem(last=False)
                self._bytes -= size
            _unlink(self._path(key))

    def bytes_used(self) -> int:
        return self._bytes

    def close(self) -> None:
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
