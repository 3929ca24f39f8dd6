"""Build (or load the cached builds of) every CPU extension at once, before serving.

Each extension is built at its first use (``build.py``); on a fresh machine that is a
minute or more apiece, and the first uses fall inside the first requests' steps. The
engine calls ``build_all`` while it starts (a server's core before it reports ready),
so no step waits on a compiler: the server's stall watch (``CoreClient``, 60 s without
a step) took that wait for a hung engine, failed the requests in flight and killed the
core mid-build, whose leftover build lock then held every restart for 15 minutes.
"""

from __future__ import annotations

__all__ = ["build_all"]


def build_all() -> None:
    """Every CPU extension's ``load``: built now or loaded from the cache. One that
    cannot build is logged by its own loader and its torch path runs, as at first use."""
    from pagewarden.kernels.cpu import attention, checksum, fused, gemm, quant

    for load in (fused.load, gemm.load, checksum.load, attention.load_extension, quant.load):
        load()
