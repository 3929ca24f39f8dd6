"""A build lock left by a process killed mid-build is removed after STALE_LOCK_S; a fresh
one (a build in progress elsewhere) is left alone."""

from __future__ import annotations

import os
import time

from pagewarden.kernels.cpu import build


def test_a_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog) -> None:
    lock = tmp_path / "lock"
    lock.write_text("")
    assert not build.remove_stale_lock(tmp_path) and lock.exists()  # a build in progress
    old = time.time() - build.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert build.remove_stale_lock(tmp_path) and not lock.exists()
    assert "removing a build lock" in caplog.text
    assert not build.remove_stale_lock(tmp_path)  # nothing to remove
