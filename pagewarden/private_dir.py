"""Per-user directories and files that other local users can neither read nor plant.

Flight records hold prompt token ids and tenant salts; compiled extensions are code that
the engine loads. Both live in directories that only their owner may enter or write:

- ``ensure_private_dir(path)`` creates missing directories with mode 0700 and refuses
  (``UnsafeDirectoryError``) a directory that is a symlink, is owned by another user, or
  that group or others may write; a directory it just created is also made 0700.
- ``create_private_file(path)`` creates a new file with mode 0600 with
  ``O_EXCL | O_NOFOLLOW``: it never follows a planted symlink and never opens a file that
  someone else put there first.

The default per-user root is ``$XDG_STATE_HOME/pagewarden`` (else
``~/.local/state/pagewarden``), not the shared temporary directory.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO


class UnsafeDirectoryError(PermissionError):
    """A directory pagewarden would write private data to is not private; says why."""


def user_state_dir() -> Path:
    """``$XDG_STATE_HOME/pagewarden`` or ``~/.local/state/pagewarden`` (not yet created)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(base) / "pagewarden"


def check_private_dir(path: Path) -> None:
    """Raise ``UnsafeDirectoryError`` unless ``path`` is a real directory of this user
    that no one else may write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafeDirectoryError(f"{path}: does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirectoryError(f"{path}: is a symlink; refusing to write private data")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectoryError(f"{path}: is not a directory")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise UnsafeDirectoryError(
            f"{path}: owned by uid {st.st_uid}, not by this user ({os.getuid()}); "
            "choose a directory of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectoryError(
            f"{path}: group or others may write it (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run `chmod go-w {path}` or choose another directory"
        )


def ensure_private_dir(path: str | Path) -> Path:
    """Create ``path`` (and missing parents) with mode 0700 and check it is private."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for p in missing:  # mkdir's mode is filtered by the umask; ours are exactly 0700
        os.chmod(p, 0o700)
    check_private_dir(path)
    return path


def create_private_file(path: str | Path) -> IO[str]:
    """A new text file at ``path``, mode 0600, never through a symlink nor over an
    existing file (``FileExistsError``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    return os.fdopen(fd, "w", encoding="utf-8")
