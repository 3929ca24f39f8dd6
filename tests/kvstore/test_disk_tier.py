"""The disk tier on its own: atomic writes, concurrent writers, LRU within the size."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from pagewarden.kvstore.disk import DiskTier
from pagewarden.kvstore.tier import TierError, parse_size


def _key(i: int) -> str:
    return f"{i:064x}"


def test_put_get_delete_and_persistence(tmp_path: Path):
    tier = DiskTier(tmp_path, "ns", 10_000)
    assert tier.get(_key(1)) is None
    assert tier.put(_key(1), b"a" * 100) is True
    assert tier.put(_key(1), b"a" * 100) is False  # already there
    assert tier.get(_key(1)) == b"a" * 100
    again = DiskTier(tmp_path, "ns", 10_000)  # a restart sees it
    assert again.get(_key(1)) == b"a" * 100 and again.bytes_used() == 100
    again.delete(_key(1))
    assert tier.get(_key(1)) is None and again.bytes_used() == 0
    assert not list(tmp_path.rglob("*.tmp"))


def test_lru_within_the_size(tmp_path: Path):
    tier = DiskTier(tmp_path, "ns", 350)
    for i in range(3):
        tier.put(_key(i), bytes([i]) * 100)
        time.sleep(0.01)
    assert tier.get(_key(0)) is not None  # 0 is now the most recently used
    tier.put(_key(3), b"x" * 100)  # 400 > 350: the least recently used (1) goes
    assert tier.get(_key(1)) is None
    assert all(tier.get(_key(i)) is not None for i in (0, 2, 3))
    assert tier.bytes_used() == 300
    # A restart orders by modification time (a hit touches its file).
    again = DiskTier(tmp_path, "ns", 250)
    again.put(_key(4), b"y" * 100)
    assert again.bytes_used() <= 250 and again.get(_key(4)) is not None


def test_concurrent_writers_and_readers_never_see_a_partial_entry(tmp_path: Path):
    tiers = [DiskTier(tmp_path, "ns", 10**9) for _ in range(4)]
    value = os.urandom(1 << 20)  # big enough that a non-atomic write would be seen half done
    seen: list[int] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            got = tiers[0].get(_key(7))
            if got is not None:
                seen.append(len(got))
                assert got == value

    def write(t: DiskTier) -> None:
        for _ in range(20):
            t.put(_key(7), value)
            t.delete(_key(7))

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(t,)) for t in tiers]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert all(n == len(value) for n in seen)
    assert not list(tmp_path.rglob("*.tmp"))


def test_unwritable_directory_is_a_tier_error(tmp_path: Path):
    if os.geteuid() == 0:
        blocker = tmp_path / "file"
        blocker.write_bytes(b"")
        with pytest.raises(TierError):
            DiskTier(blocker, "ns", 100)  # a file where the directory should be
        return
    os.chmod(tmp_path, 0o500)
    with pytest.raises(TierError):
        DiskTier(tmp_path / "sub", "ns", 100)


def test_parse_size():
    assert parse_size("1KiB") == 1024 and parse_size(5) == 5 and parse_size("2GB") == 2 * 10**9
    for bad in ("", "1 parsec", "-1", 0):
        with pytest.raises(ValueError):
            parse_size(bad)
