"""Private directories and files: 0700 / 0600, never through a symlink, never another
user's or a world-writable directory."""

from __future__ import annotations

import os
import stat

import pytest

from pagewarden.private_dir import (
    UnsafeDirectoryError,
    create_private_file,
    ensure_private_dir,
    user_state_dir,
)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_created_directories_are_0700_whatever_the_umask(tmp_path) -> None:
    old = os.umask(0)
    try:
        target = ensure_private_dir(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert _mode(target) == 0o700 and _mode(tmp_path / "a") == 0o700
    assert _mode(tmp_path) != 0 and ensure_private_dir(target) == target  # idempotent


def test_world_writable_and_symlinked_directories_are_refused(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeDirectoryError, match="others may write"):
        ensure_private_dir(shared)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UnsafeDirectoryError, match="symlink"):
        ensure_private_dir(tmp_path / "link")


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a directory's owner needs root")
def test_another_users_directory_is_refused(tmp_path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(UnsafeDirectoryError, match="owned by uid 12345"):
        ensure_private_dir(theirs)


def test_private_files_are_0600_and_never_follow_or_reuse(tmp_path) -> None:
    with create_private_file(tmp_path / "record.tmp") as f:
        f.write("x")
    assert _mode(tmp_path / "record.tmp") == 0o600
    with pytest.raises(FileExistsError):
        create_private_file(tmp_path / "record.tmp")
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "planted").symlink_to(victim)
    with pytest.raises(OSError):
        create_private_file(tmp_path / "planted")
    assert victim.read_text() == "keep"


def test_the_default_state_directory_is_per_user(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert user_state_dir() == tmp_path / "pagewarden"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert str(user_state_dir()).startswith(os.path.expanduser("~"))
