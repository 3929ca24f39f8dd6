"""The cyclic garbage collector's settings for a process that serves requests.

Python collects its youngest generation after every 700 net allocations of container
objects, and walks the older generations every 10th and 100th time. A serving process
allocates a few container objects per request and per step (a request's token lists, its
block table, the step's scheduler output); at batch 256 the young generation fills every
step or two, and each collection walks the token lists of every request admitted since
the last one, then promotes them, so the older collections walk every live request. Almost
none of it is garbage: requests die by reference counting when they finish.

``tune_gc_for_serving`` collects the young generation less often (``gen0_threshold``) and
freezes what is alive at start-up (model, tokenizer, app: a large, static heap that no later
collection needs to walk). Cycles are still collected, just in larger batches.
``pagewarden serve`` applies it once the engine is built; ``bench/control_plane.py`` reports
the control plane both ways.
"""

from __future__ import annotations

import gc

#: Young-generation threshold while serving (Python's default is 700).
SERVING_GEN0_THRESHOLD = 20_000


def tune_gc_for_serving(
    gen0_threshold: int = SERVING_GEN0_THRESHOLD, freeze: bool = True
) -> tuple[int, int, int]:
    """Collect the young generation every ``gen0_threshold`` net container allocations and,
    with ``freeze``, move every object alive now to the permanent generation (after one
    full collection, so no garbage is frozen). Returns the previous thresholds, for
    ``gc.set_threshold(*previous)``. Raises ValueError for a threshold below 1."""
    if gen0_threshold < 1:
        raise ValueError(f"gen0_threshold must be >= 1, got {gen0_threshold}")
    previous = gc.get_threshold()
    if freeze:
        gc.collect()
        gc.freeze()
    gc.set_threshold(gen0_threshold, previous[1], previous[2])
    return previous
