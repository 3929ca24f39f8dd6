"""Control-plane throughput: scheduler + block pool with a fake runner (no model).

Requests of 64 prompt tokens (a 16-token shared prefix) and 16 output tokens.
Prints sustained requests/s, block ops/s, and median schedule() time at batch 32 and 256.

    python bench/control_plane.py [--runs 5] [--requests 20000] [--batch 32 256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagewarden.sampling_params import SamplingParams  # noqa: E402
from pagewarden.sched import Request, Scheduler, SchedulerConfig  # noqa: E402
from pagewarden.sched.fake_runner import FakeModelRunner  # noqa: E402


def _requests(n: int, rng: random.Random) -> list[Request]:
    prefix = [rng.randrange(32000) for _ in range(16)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    return [
        Request(f"r{i}", prefix + [rng.randrange(32000) for _ in range(48)], params)
        for i in range(n)
    ]


def run(num_requests: int, batch: int) -> tuple[float, float, float]:
    cfg = SchedulerConfig(num_blocks=batch * 6 + 64, block_size=16, max_num_seqs=batch,
                          max_num_batched_tokens=max(2048, batch * 64), max_model_len=2048)
    s = Scheduler(cfg)
    runner = FakeModelRunner(16)
    reqs = _requests(num_requests, random.Random(0))
    sched_times = []
    t0 = time.perf_counter()
    it = iter(reqs)
    for r in it:
        s.add_request(r)
        if len(s.waiting) >= batch:
            break
    while s.has_unfinished_requests():
        a = time.perf_counter()
        out = s.schedule()
        sched_times.append(time.perf_counter() - a)
        for _ in s.update(out, runner.execute(out)).finished:
            nxt = next(it, None)
            if nxt is not None:
                s.add_request(nxt)
    elapsed = time.perf_counter() - t0
    pool = s.kv.pool
    block_ops = pool.num_allocations + pool.num_frees
    return num_requests / elapsed, block_ops / elapsed, statistics.median(sched_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=5,
                        help="runs per batch size, alternated; the median is reported")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    args = parser.parse_args()
    results: dict[int, list[tuple[float, float, float]]] = {b: [] for b in args.batch}
    for _ in range(args.runs):  # alternate, so drift on a shared machine hits all sizes
        for batch in args.batch:
            results[batch].append(run(args.requests, batch))
    for batch, runs in results.items():
        rps = [r[0] for r in runs]
        ops = statistics.median(r[1] for r in runs)
        med = statistics.median(r[2] for r in runs)
        print(f"batch={batch}: {statistics.median(rps):,.0f} requests/s median of {len(rps)} "
              f"(min {min(rps):,.0f}, max {max(rps):,.0f}), {ops:,.0f} block ops/s, "
              f"median schedule() {med * 1e6:.1f} us (target 14,720 requests/s)")


if __name__ == "__main__":
    main()
