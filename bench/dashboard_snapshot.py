"""The dashboard snapshot's cost next to an engine step, at batch 64, on the default model.

    python bench/dashboard_snapshot.py [--batch 64] [--steps 8] [--model PATH]

``batch`` requests (random 32-token prompts, greedy, ``ignore_eos``) are prefilled on an
``EngineCore`` with the default pool (1 GiB of KV); then, between decode steps, the
snapshot the dashboard asks for is taken as the engine-core process takes it:
``take_snapshot(core)`` plus pickling it for the pipe. Prints the median decode step,
the median snapshot, their ratio (the target is under 1%) and the share of engine time
at the dashboard's rate (one snapshot a second at most).
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("PAGEWARDEN_ROOT") or str(Path(__file__).resolve().parents[1]))

from pagewarden.engine.config import EngineConfig  # noqa: E402
from pagewarden.engine.core import EngineCore  # noqa: E402
from pagewarden.engine.snapshot import take_snapshot  # noqa: E402
from pagewarden.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed")
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    core = EngineCore(EngineConfig(model=args.model, dtype=args.dtype))
    rng = random.Random(0)
    vocab = core.loaded.config.vocab_size
    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(args.batch):
        core.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(32)], params)
    while len(core.scheduler.running) < args.batch or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()  # prefill
    steps, snaps, size = [], [], 0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        blob = pickle.dumps(take_snapshot(core))
        snaps.append(time.perf_counter() - t0)
        size = len(blob)
    step, snap = statistics.median(steps), statistics.median(snaps)
    print(
        f"batch {args.batch}, {core.scheduler.kv.pool.num_blocks} KV blocks, "
        f"{core.scheduler.stats().used_blocks} used, snapshot {size / 1024:.0f} KiB pickled"
    )
    print(f"decode step   {step * 1e3:8.2f} ms (median of {len(steps)})")
    print(f"snapshot      {snap * 1e3:8.3f} ms (take_snapshot + pickle, median)")
    print(f"snapshot / step            {snap / step * 100:6.3f} %   (target < 1 %)")
    print(f"engine time at 1 snapshot/s {snap * 100:6.3f} %")


if __name__ == "__main__":
    main()
