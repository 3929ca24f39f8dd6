"""Control-plane throughput: scheduler + block pool with a fake runner (no model).

Requests of 64 prompt tokens (a 16-token shared prefix) and 16 output tokens.
Prints sustained requests/s, block ops/s, and median schedule() time at batch 32 and 256.

    python bench/control_plane.py
"""

from __future__ import annotations

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
    for batch in (32, 256):
        rps, ops, med = run(20000, batch)
        print(f"batch={batch}: {rps:,.0f} requests/s, {ops:,.0f} block ops/s, "
              f"median schedule() {med * 1e6:.1f} us (target 14,720 requests/s)")


if __name__ == "__main__":
    main()
