"""Build (or load the cached builds of) every CPU extension at once, before serving.

Each extension is built at its first use (``build.py``); on a fresh machine that is a
minute or more apiece, and the first uses fall inside the first requests' steps. The
engine calls ``build_all`` while it starts (a server's core before it reports ready),
so no step waits on a compiler: the server's stall watch (``CoreClient``, 60 s without
a step) took that wait for a hung engine, failed the requests in flight and killed the
core mid-build, whose leftover build lock then held every restart for 15 minutes.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

__all__ = ["build_all"]


def build_all() -> None:
    """Every CPU extension's ``load``: built now or loaded from the cache. One that
    cannot build is logged by its own loader and its torch path runs, as at first use.

    The builds run on as many threads as there are cores (at most 4): most extensions
    are one translation unit, whose compile keeps one core busy, so one after another
    they left the others idle (six builds, 199 s in a row on a 2-core Zen 4, about 30 s
    apiece for torch/extension.h). An extension that binds to another (all but checksum
    to the item pool, quant to fused's norm) waits on that one's build lock, not on the
    rest."""
    from pagewarden.kernels.cpu import attention, checksum, fused, gemm, quant
    from pagewarden.kernels.cpu import pool as cpu_pool

    # First the pool (the others bind to it) and the two extensions of several files.
    loads = [
        cpu_pool.load,
        quant.load,
        attention.load_extension,
        fused.load,
        gemm.load,
        checksum.load,
    ]
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="pw-build") as ex:
        for f in [ex.submit(load) for load in loads]:
            f.result()
