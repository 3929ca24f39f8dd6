"""KV tiers on a prefix-heavy workload: TTFT and output tok/s with no tier, the disk tier,
the Redis tier, and a restarted engine on a warm disk tier; the cost of a verified block
load against recomputing the block; the cost of tier writes on decode throughput.

    python bench/kv_tiers.py            # the issue's workload (32 x 1,500 tokens, 4 uses)
    python bench/kv_tiers.py --quick    # 8 x 512 tokens, 3 uses; 16 decode requests, 4 rounds

Prefix workload: ``--num-prefixes`` distinct system prompts of ``--prefix-len`` tokens,
each reused by ``--uses`` requests (a short distinct question each), in shuffled order,
one request at a time (TTFT is then the request's own prefill, not queueing), greedy,
``--output-len`` tokens. The device pool holds about a quarter of the prefixes, so most
reuses find their prefix evicted: recomputed without a tier, loaded (verified) with one.
One model load; every engine gets the same requests. Redis runs when ``redis-server`` is
installed (started here on a free loopback port, stopped at the end).

Per block: a verified load is the wall time of a request's load job (the loader fetches
several blocks at once, each checked by ``decode_entry``) per block it loaded, plus
landing it in the pool (the copy and the checksum over the pool's bytes, timed around
the runner's calls); the latency of one fetch + verify
(``pagewarden:kv_tier_load_seconds``) is shown too. Recomputing a block is the no-tier
TTFT of a prefix's first use (nothing cached) divided by its blocks.

Write cost: a decode-heavy run (``--decode-requests`` distinct short prompts, 8 at a
time, ``--decode-len`` tokens each) in a pool small enough that every new block evicts a
finished request's cached block, so the tier writer stores all through the run; output
tok/s with the disk tier on and off in ``--decode-rounds`` rounds of one pair each
(off/on, then on/off, ...); the cost is the median of the pairs' 1 - on/off. ``uptime`` is printed at the start and the end: on a shared machine the
figures are indicative only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagewarden.engine.config import EngineConfig  # noqa: E402
from pagewarden.engine.core import EngineCore  # noqa: E402
from pagewarden.models.loader import load_model  # noqa: E402
from pagewarden.sampling_params import SamplingParams  # noqa: E402

TTFT_TARGET, LOAD_TARGET, WRITE_TARGET = 0.5, 0.10, 0.02


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The shuffled requests, and the indices of each prefix's first use."""
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(100, vocab) for _ in range(args.prefix_len)]
        for _ in range(args.num_prefixes)
    ]
    tagged = [
        (p, prefixes[p] + [rng.randrange(100, vocab) for _ in range(16)])
        for p in range(args.num_prefixes)
        for _ in range(args.uses)
    ]
    rng.shuffle(tagged)
    seen: set[int] = set()
    first_uses = []
    for i, (p, _) in enumerate(tagged):
        if p not in seen:
            seen.add(p)
            first_uses.append(i)
    return [ids for _, ids in tagged], first_uses


def run(
    engine: EngineCore, reqs: list[list[int]], output_len: int
) -> tuple[list[float], float, list[list[int]]]:
    """One request at a time: TTFT of each, output tok/s over the run, the tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ttfts, outputs = [], []
    start_all = time.perf_counter()
    for i, ids in enumerate(reqs):
        start = time.perf_counter()
        engine.add_request(str(i), ids, params)
        first = None
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter()
                if out.finished:
                    tokens = list(out.outputs[0].token_ids)
        ttfts.append((first or time.perf_counter()) - start)
        outputs.append(tokens)
    elapsed = time.perf_counter() - start_all
    return ttfts, len(reqs) * output_len / elapsed, outputs


def time_jobs(engine: EngineCore) -> list[Any]:
    """Collect the tier load jobs the engine starts (their wall time per loaded block is
    the load cost with fetches in parallel)."""
    jobs: list[Any] = []
    if engine.kv_tiers is None:
        return jobs
    tp = engine.scheduler.tier_prefix
    start = tp.start

    def tracked(chain: Any) -> Any:
        job = start(chain)
        jobs.append(job)
        return job

    tp.start = tracked
    return jobs


def job_seconds_per_block(jobs: list[Any]) -> float:
    """Wall time of the loads that found blocks, per block loaded."""
    done = [j for j in jobs if j.finished is not None and j.blocks]
    blocks = sum(len(j.blocks) for j in done)
    return sum(j.finished - j.issued for j in done) / blocks if blocks else 0.0


def time_landing(engine: EngineCore) -> list[float]:
    """Wrap the runner's tier-load landing (copy into the pool, checksum there); the
    returned list collects [seconds, blocks] totals."""
    totals = [0.0, 0.0]
    store, guard = engine.runner.kv_store, engine.runner.guard
    write, tier_in = store.write_blocks, guard.tier_in

    def timed_write(ids: list[int], payloads: list[bytes]) -> None:
        t = time.perf_counter()
        write(ids, payloads)
        totals[0] += time.perf_counter() - t
        totals[1] += len(ids)

    def timed_tier_in(out: Any) -> Any:
        t = time.perf_counter()
        faults = tier_in(out)
        totals[0] += time.perf_counter() - t
        return faults

    store.write_blocks, guard.tier_in = timed_write, timed_tier_in
    return totals


def start_redis(directory: Path) -> tuple[subprocess.Popen, str] | None:
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):  # until it accepts connections
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def prefix_runs(args: argparse.Namespace, loaded: Any, tmp: Path) -> dict[str, dict[str, Any]]:
    """The prefix workload per configuration: TTFTs, tok/s, tokens, tier figures."""
    reqs, first_uses = workload(args, loaded.config.vocab_size)
    per_prefix = (args.prefix_len + 16 + args.output_len) // args.block_size + 2
    base = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=max(per_prefix * args.num_prefixes // 4, 2 * per_prefix) + 1,
        max_num_seqs=1,
        max_num_batched_tokens=2048,
        flight_recorder_steps=0,
        adaptive_batch=False,
    )
    print(
        f"prefix workload: {args.num_prefixes} prefixes x {args.prefix_len} tokens, "
        f"{args.uses} uses each, {args.output_len} out, {args.dtype}, "
        f"pool {base.num_kv_blocks} blocks of {args.block_size}",
        flush=True,
    )
    redis = None if args.no_redis else start_redis(tmp)
    configs = [("no tier", base), ("disk", replace_dir(base, tmp / "disk"))]
    if redis is not None:
        configs.append(("redis", dataclasses.replace(base, kv_offload_redis=redis[1])))
    configs.append(("disk, restarted", replace_dir(base, tmp / "disk")))
    results: dict[str, dict[str, Any]] = {}
    try:
        for name, cfg in configs:
            engine = EngineCore(cfg, loaded)
            landing, jobs = time_landing(engine), time_jobs(engine)
            ttfts, tps, outs = run(engine, reqs, args.output_len)
            r: dict[str, Any] = {"ttfts": ttfts, "tps": tps, "outs": outs}
            if engine.kv_tiers is not None:
                engine.kv_tiers.flush()
                s = engine.kv_tiers.stats()
                r["stats"], r["landing"], r["job"] = s, landing, job_seconds_per_block(jobs)
                engine.shutdown()  # a clean stop: the pool's prefixes go too
            else:
                r["cold"] = [ttfts[i] for i in first_uses]
            results[name] = r
            equal = outs == results["no tier"]["outs"]
            print(
                f"  {name:<16} TTFT p50 {statistics.median(ttfts) * 1e3:8.1f} ms  "
                f"output {tps:6.2f} tok/s  tokens equal to no tier: {equal}",
                flush=True,
            )
    finally:
        if redis is not None:
            redis[0].terminate()
            redis[0].wait()
    blocks = (args.prefix_len + 16) // args.block_size
    results["no tier"]["recompute_block"] = statistics.median(results["no tier"]["cold"]) / blocks
    return results


def replace_dir(base: EngineConfig, directory: Path) -> EngineConfig:
    return dataclasses.replace(base, kv_offload_dir=str(directory))


def decode_run(
    loaded: Any, cfg: EngineConfig, prompts: list[list[int]], n: int
) -> tuple[float, int, int]:
    """Output tok/s of ``prompts`` run 8 at a time (continuous batching), ``n`` tokens each;
    blocks stored to the tier and dropped (queue full)."""
    engine = EngineCore(cfg, loaded)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    start = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                produced += len(out.outputs[0].token_ids)
    tps = produced / (time.perf_counter() - start)
    if engine.kv_tiers is None:
        return tps, 0, 0
    engine.kv_tiers.flush()
    s = engine.kv_tiers.stats()
    engine.kv_tiers.close()
    return tps, sum(s.stores.values()), s.offload_dropped


def write_cost(args: argparse.Namespace, loaded: Any, tmp: Path) -> dict[str, Any]:
    """Decode tok/s with the disk tier off and on, alternated; medians and their ratio."""
    rng = random.Random(args.seed + 1)
    vocab = loaded.config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(64)] for _ in range(args.decode_requests)]
    per_req = (64 + args.decode_len) // args.block_size + 2
    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=8 * per_req + 8,  # 8 running; each new block evicts a cached one
        max_num_seqs=8,
        flight_recorder_steps=0,
        adaptive_batch=False,  # it would shrink the batch mid-run on a slow step
    )
    print(
        f"decode run: {args.decode_requests} requests x 64 prompt + {args.decode_len} out, "
        f"8 at a time, pool {cfg.num_kv_blocks} blocks; {args.decode_rounds} rounds off/on",
        flush=True,
    )
    off, on, costs, stores, dropped = [], [], [], 0, 0
    for i in range(args.decode_rounds):  # off/on, on/off, ...: each round a pair
        got = {}
        for tier in [False, True] if i % 2 == 0 else [True, False]:
            c = replace_dir(cfg, tmp / f"decode-{i}") if tier else cfg
            tps, n_stored, n_dropped = decode_run(loaded, c, prompts, args.decode_len)
            stores, dropped = stores + n_stored, dropped + n_dropped
            got[tier] = tps
            print(f"  round {i} tier {'on ' if tier else 'off'} {tps:7.2f} tok/s", flush=True)
            shutil.rmtree(tmp / f"decode-{i}", ignore_errors=True)
        off.append(got[False])
        on.append(got[True])
        costs.append(1.0 - got[True] / got[False])
    return {
        "off": statistics.median(off),
        "on": statistics.median(on),
        "cost": statistics.median(costs),  # the median of the rounds' pairs
        "stores": stores,
        "dropped": dropped,
    }


def summary(results: dict[str, dict[str, Any]], wc: dict[str, Any] | None) -> bool:
    """Print the per-configuration figures and the three targets; True if all are met."""
    ref = results["no tier"]
    ref_ttft, recompute = statistics.median(ref["ttfts"]), ref["recompute_block"]
    print(f"\nrecompute one block (no-tier cold prefill / blocks): {recompute * 1e3:.2f} ms")
    print(
        f"{'config':<16} {'TTFT p50':>10} {'ratio':>6} {'tok/s':>8} {'hits':>6} {'stores':>6} "
        f"{'1 fetch':>9} {'job/block':>10} {'landing':>9} {'load/recompute':>15}"
    )
    ttft_ratios, load_ratios = [], []
    for name, r in results.items():
        ttft = statistics.median(r["ttfts"])
        line = f"{name:<16} {ttft * 1e3:8.1f}ms {ttft / ref_ttft:6.2f} {r['tps']:8.2f}"
        if name != "no tier":
            ttft_ratios.append((name, ttft / ref_ttft))
        s = r.get("stats")
        if s is not None and s.load_latency.count:
            fetch = s.load_latency.total / s.load_latency.count
            land_s, land_n = r["landing"]
            land = land_s / land_n if land_n else 0.0
            ratio = (r["job"] + land) / recompute
            load_ratios.append((name, ratio))
            line += (
                f" {sum(s.hits.values()):6d} {sum(s.stores.values()):6d} "
                f"{fetch * 1e3:6.2f} ms {r['job'] * 1e3:7.2f} ms {land * 1e3:6.2f} ms "
                f"{ratio:15.3f}"
            )
        print(line)
    rows = [
        ("TTFT p50 with a tier / without", ttft_ratios, TTFT_TARGET, "<="),
        ("verified block load / recompute", load_ratios, LOAD_TARGET, "<="),
    ]
    if wc is not None:
        cost = wc["cost"]
        print(
            f"\ndecode tok/s: tier off {wc['off']:.2f}, on {wc['on']:.2f} (medians; the cost is "
            f"the median of the rounds' on/off pairs); "
            f"{wc['stores']} blocks stored, {wc['dropped']} dropped (queue full)"
        )
        rows.append(("decode tok/s lost to tier writes", [("disk", cost)], WRITE_TARGET, "<"))
    print(f"\n{'target':<34} {'measured':<36} {'bound':>7}  met")
    ok = True
    for label, values, bound, op in rows:
        met = bool(values) and all(v <= bound if op == "<=" else v < bound for _, v in values)
        ok &= met
        shown = ", ".join(f"{n} {v:.3f}" for n, v in values) or "not measured"
        print(f"{label:<34} {shown:<36} {op}{bound:5.2f}  {'yes' if met else 'NO'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--quick", action="store_true", help="8 x 512 tokens, 3 uses; a short decode")
    ap.add_argument("--num-prefixes", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=1500)
    ap.add_argument("--uses", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--decode-requests", type=int, default=32)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--decode-rounds", type=int, default=6)
    ap.add_argument("--skip-decode", action="store_true", help="no write-cost run")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.num_prefixes, args.prefix_len, args.uses = 8, 512, 3
        args.decode_requests, args.decode_len, args.decode_rounds = 16, 128, 4
    print(f"uptime at start: {os.popen('uptime').read().strip()}", flush=True)
    loaded = load_model(args.model, EngineConfig(dtype=args.dtype).torch_dtype)
    tmp = Path(tempfile.mkdtemp(prefix="pagewarden-bench-kv-tiers-"))
    try:
        results = prefix_runs(args, loaded, tmp)
        wc = None if args.skip_decode else write_cost(args, loaded, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ok = summary(results, wc)
    print(f"\nuptime at end: {os.popen('uptime').read().strip()}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
