"""Decode steps on one thread against all threads, by batch size (real model).

    python bench/step_threads.py                      # batches 1 2 4 8 16 32
    python bench/step_threads.py --batch 1 4 --rounds 5

One engine per batch size (default GGUF, integrity standard, prefix caching off, the
engine's OpenMP wait policy); after prefill, rounds of ``--steps`` decode steps alternate
``torch.set_num_threads(1)`` and the full thread count, and the median ms/step of each is
printed with their ratio. With ``OMP_WAIT_POLICY=PASSIVE`` (the default) every OpenMP
parallel region wakes sleeping threads, which costs more than a tiny step gains from a
second core: run with ``PAGEWARDEN_NO_CPU_POOL=1`` this finds the step size below which
one thread is faster (``worker/cpu_threads.py`` SERIAL_STEP_TOKENS). Where the GEMMs run
on the kernels' pool (the default with the bf16 kernel), whose idle worker polls between
kernels, it shows whether two threads now win at every size (they did: the engine then
uses all threads for every step). Note ``uptime`` beside the figures.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the engine's default, before torch loads

    import torch

    from pagewarden.engine.config import EngineConfig
    from pagewarden.engine.core import EngineCore
    from pagewarden.sampling_params import SamplingParams

    print(f"uptime: {os.popen('uptime').read().strip()}")
    full = torch.get_num_threads()
    engine = EngineCore(EngineConfig(enable_prefix_caching=False, serial_step_tokens=0))
    rng = random.Random(0)
    for batch in args.batch:
        for i in range(batch):
            prompt = [rng.randrange(1000, 40000) for _ in range(128)]
            n = args.steps * args.rounds * 2 + 8
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            engine.add_request(f"b{batch}-{i}", prompt, params)
        for _ in range(4):  # prefill, and a few decode steps to settle
            engine.step()
        times: dict[int, list[float]] = {1: [], full: []}
        for r in range(args.rounds):
            for threads in (1, full) if r % 2 else (full, 1):
                torch.set_num_threads(threads)
                step_times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    engine.step()
                    step_times.append(time.perf_counter() - t0)
                times[threads].append(statistics.median(step_times) * 1e3)
        torch.set_num_threads(full)
        one, many = statistics.median(times[1]), statistics.median(times[full])
        print(
            f"batch {batch:3d}: 1 thread {one:7.1f} ms/step, {full} threads {many:7.1f} "
            f"ms/step, 1 thread is {many / one:.2f}x as fast",
            flush=True,
        )
        while engine.has_unfinished():
            for req in list(engine.scheduler.running):
                engine.abort_request(req.req_id)
            engine.step()
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
