"""Prefix-aware routing vs Ray Serve's default power-of-two router, side by side.

    python bench/serve_routing.py --tiny                  # a tiny random Llama (quick)
    python bench/serve_routing.py                         # the default model

Starts a local Ray instance, deploys ``pagewarden.serve.ray`` with 2 engine replicas and
the prefix-aware router, sends the workload through Serve's HTTP proxy, then redeploys
with Serve's default router and sends the same workload. The workload: ``--tenants``
API keys (each its own cache salt, so tenants never share blocks), ``--system-prompts``
shared system prompts, every request = one tenant's key + one system prompt + a unique
question, in a seeded random order, ``--concurrency`` at a time. Prints, per router,
the prefix-cache hit rate (prompt tokens served from the cache / prompt tokens looked
up, summed over replicas), requests/s, prompt tokens/s, and how prompt tokens spread
over the replicas; then the ratios prefix / pow2.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SYSTEM = (
    "You are assistant number {i} of the pagewarden help desk. Answer briefly, cite the "
    "manual section, never invent a flag, and say when you do not know. "
)


def workload(
    tenants: int, prompts: int, per_tenant: int, repeat: int, seed: int
) -> list[tuple[str, str]]:
    """(api key, prompt) per request, shuffled."""
    rng = random.Random(seed)
    reqs = [
        (
            f"tenant-{t}",
            SYSTEM.format(i=rng.randrange(prompts)) * repeat + f" Question {t}.{q}: why?",
        )
        for t in range(tenants)
        for q in range(per_tenant)
    ]
    rng.shuffle(reqs)
    return reqs


def replicas(url: str, key: str) -> list[dict]:
    auth = {"Authorization": f"Bearer {key}"}
    return httpx.get(url + "/v1/replicas", headers=auth, timeout=30).json()["data"]


def run_workload(url: str, model: str, reqs, concurrency: int, max_tokens: int) -> dict:
    def one(req: tuple[str, str]) -> int:
        key, prompt = req
        r = httpx.post(
            url + "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
            timeout=300,
        )
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
        return r.json()["usage"]["prompt_tokens"]

    before = {r["replica_id"]: r for r in replicas(url, reqs[0][0])}
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        prompt_tokens = sum(pool.map(one, reqs))
    wall = time.perf_counter() - t0
    time.sleep(1.5)  # let every replica's digest catch up
    after = {r["replica_id"]: r for r in replicas(url, reqs[0][0])}

    def delta(field: str) -> dict[str, int]:
        return {k: v[field] - before.get(k, {}).get(field, 0) for k, v in after.items()}

    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    return {
        "hit_rate": sum(hits.values()) / max(1, sum(queries.values())),
        "req_per_s": len(reqs) / wall,
        "prompt_tok_per_s": prompt_tokens / wall,
        "spread": sorted(delta("prompt_tokens").values(), reverse=True),
        "wall_s": wall,
    }


def deploy(router: str, args, engine: dict, keys: list[str], port: int) -> None:
    from ray import serve

    from pagewarden.serve.options import ServeOptions
    from pagewarden.serve.ray import build_app

    options = ServeOptions(
        engine=engine,
        served_model_name="bench",
        api_keys=tuple(keys),
        num_replicas=args.replicas,
        num_cpus_per_replica=2 / args.replicas,
        router=router,
    )
    serve.run(build_app(options), name=router, route_prefix="/")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama (float32)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--system-prompts", type=int, default=2)
    ap.add_argument("--system-repeat", type=int, default=1, help="system prompt length x")
    ap.add_argument("--per-tenant", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--num-kv-blocks", type=int, default=96, help="per replica")
    ap.add_argument("--port", type=int, default=18240)
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import ray
    from ray import serve

    engine: dict = dict(num_kv_blocks=args.num_kv_blocks, block_size=16, cpu_threads=1)
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from conftest import make_tiny_llama

        engine.update(
            model=str(make_tiny_llama(Path(tempfile.mkdtemp()) / "tiny")),
            dtype="float32",
            max_model_len=256,
        )
    elif args.model:
        engine["model"] = args.model
    keys = [f"tenant-{t}" for t in range(args.tenants)]
    reqs = workload(args.tenants, args.system_prompts, args.per_tenant, args.system_repeat, seed=0)
    url = f"http://127.0.0.1:{args.port}"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    results = {}
    try:
        for router in ("prefix", "pow2"):
            deploy(router, args, engine, keys, args.port)
            run_workload(url, "bench", reqs[:2], 2, 1)  # warm up (first-call costs)
            results[router] = run_workload(url, "bench", reqs, args.concurrency, args.max_tokens)
            serve.delete(router)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"command: python {' '.join(sys.argv)}")
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(
        f"{len(reqs)} requests, {args.tenants} tenants x {args.system_prompts} system prompts, "
        f"{args.replicas} replicas, concurrency {args.concurrency}, max_tokens {args.max_tokens}"
    )
    print(
        f"{'router':8} {'hit rate':>9} {'req/s':>7} {'prompt tok/s':>13}  prompt tokens per replica"
    )
    for name, r in results.items():
        print(
            f"{name:8} {r['hit_rate']:9.3f} {r['req_per_s']:7.2f} {r['prompt_tok_per_s']:13.1f}"
            f"  {r['spread']}"
        )
    p, q = results["prefix"], results["pow2"]
    print(
        f"prefix / pow2: hit rate {p['hit_rate'] / max(q['hit_rate'], 1e-9):.2f}x, "
        f"throughput {p['req_per_s'] / q['req_per_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
