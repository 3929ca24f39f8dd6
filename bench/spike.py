"""Spike test of ``pagewarden serve``: a real load generator against the real server.

Load generator: autocannon (npm), which this project does not write. The script uses
``$PAGEWARDEN_AUTOCANNON`` if set, else ``autocannon`` on PATH, else
``~/.cache/pagewarden-bench/node_modules/.bin/autocannon``, installing it there with
``npm install --prefix ~/.cache/pagewarden-bench autocannon@7`` when missing (outside
the repository; needs npm and the npm registry once).

What it does, all on loopback and bounded in time:

1. starts ``pagewarden serve`` with default flags (plus ``--model`` if given);
2. measures a few patient probe requests alone (the baseline), then as many with
   ``--burn-cores`` busy-loop processes beside the idle server: the probe's time under
   the CPU contention that autocannon and the 429 path bring, without their traffic;
3. offers ``--rate`` small ``/v1/completions`` POSTs per second for ``--duration`` s from
   ``--connections`` connections, while probe clients (which honour Retry-After) measure
   the requests they get accepted and a pinger reads ``/health`` every 100 ms;
4. waits for the drain and reads the KV pool from ``/metrics``.

It prints responses/s, status-code counts, latency of the load's responses (p50/p99; at
least 99% of them are 429s under the spike, the share is printed), probe latency during
the spike against the baseline, ``/health`` misses (non-200 or slower than 1 s), RSS of
both processes before and after, the KV pool after the drain, and the front door's CPU
time per 429 (the HTTP process's CPU time over the spike divided by the 429s; it also
pays for the accepted requests, so it is an upper bound), each against its target. The probe's ratio splits in two: burnt/alone is what the
shared cores cost, spike/burnt what the spike's admitted load and front door add.

Probes: each probe's sample is its first request, sent just before autocannon starts and
admitted as the flood arrives. After that a client that honours Retry-After almost never
wins a freed slot from 14,720 requests a second that do not wait (in every run so far
each probe was admitted exactly once), so the probe figure is the latency of the
requests admitted at the spike's onset: the gate's worst moment, before any window has
seen the flood. Four probes stand for a handful of interactive users among the flood:
an eighth of the onset batch (what ran healthy, here the probes, plus the gate's burst
of 32). With twelve they were a third of the batch, and once the load's 16-token
requests finished, the batch the probes finished in was mostly the probes themselves.
The accepted tokens per second are the engine's generated tokens over the spike (load
and probes): what admission keeps serving while it sheds.

Latency: autocannon runs with ``-C`` (no coordinated-omission correction), so each
response counts once, from the moment its request was sent. Its correction back-fills
every response slower than the expected interval with one synthetic sample per
interval, and autocannon 7.15 takes that interval as ``ceil(1 / rate)`` ms with the
per-connection rate in requests per second: 1 ms, not 70. An admitted request answered
in 2 s then counted as 2,000 samples, and the 0.2% of answers that were 200s made up
10-14% of the histogram: the "p99" printed before this change (about 2 s) was theirs.
Raw, the 200s are the slowest 0.2% (they generate tokens), so the p99 over all responses
is an upper bound on the 429s' p99; the accepted requests' latency is the probes'.

    python bench/spike.py                      # the issue's spike: 14,720 req/s, 15 s, 1,024 conns
    python bench/spike.py --rate 2000 --duration 5 --connections 128   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

CACHE = Path.home() / ".cache" / "pagewarden-bench"
ROOT = Path(__file__).resolve().parents[1]


def find_autocannon() -> str:
    """Path of autocannon; installs it into ``CACHE`` with npm when it is nowhere."""
    for candidate in (
        os.environ.get("PAGEWARDEN_AUTOCANNON"),
        shutil.which("autocannon"),
        str(CACHE / "node_modules" / ".bin" / "autocannon"),
    ):
        if candidate and Path(candidate).is_file():
            return candidate
    if shutil.which("npm") is None:
        raise SystemExit("autocannon not found and npm is missing: install Node.js and npm")
    CACHE.mkdir(parents=True, exist_ok=True)
    print(f"installing autocannon: npm install --prefix {CACHE} autocannon@7", flush=True)
    subprocess.run(
        ["npm", "install", "--prefix", str(CACHE), "--no-audit", "--no-fund", "autocannon@7"],
        check=True,
    )
    return str(CACHE / "node_modules" / ".bin" / "autocannon")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str], timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """``pagewarden serve`` on a free loopback port; returns (process, base url)."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pagewarden", "serve", "--port", str(port), *extra]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    deadline, line = time.time() + timeout, ""
    while "serving" not in line:
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"pagewarden serve did not start: {line!r}")
        line = proc.stdout.readline()
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, f"http://127.0.0.1:{port}"


def metric(url: str, name: str, prefix: str = "pagewarden:") -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(r"^" + prefix + name + r"(\{[^}]*\})? (\S+)$", text, re.M)
    return float(m.group(2)) if m else float("nan")


def rss_mib(proc: psutil.Process) -> tuple[float, float]:
    """RSS of the HTTP process and of its engine-core child, MiB."""
    children = proc.children(recursive=True)
    engine = max((c.memory_info().rss for c in children), default=0)
    return proc.memory_info().rss / 2**20, engine / 2**20


def model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


class Probe(threading.Thread):
    """A patient client: retries after Retry-After, times the accepted request (streamed:
    its first token and its whole answer)."""

    def __init__(self, url: str, body: dict, stop: threading.Event, count: int = 0) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.stop, self.count = url, body, stop, count
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.errors: list[str] = []

    def run(self) -> None:
        body = {**self.body, "stream": True}
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set() and (not self.count or len(self.latencies) < self.count):
                t0 = time.perf_counter()
                with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                    if r.status_code == 429:
                        delay = float(r.headers.get("retry-after-ms", 1000)) / 1000
                        self.stop.wait(delay)
                        continue
                    if r.status_code != 200:
                        self.errors.append(f"{r.status_code}: {r.read()[:200]!r}")
                        continue
                    ttft = None
                    for line in r.iter_lines():
                        if ttft is None and line.startswith("data: {"):
                            ttft = time.perf_counter() - t0
                self.latencies.append(time.perf_counter() - t0)
                self.ttfts.append(ttft if ttft is not None else float("nan"))


class HealthPinger(threading.Thread):
    """GET /health every 100 ms; a miss is a non-200 or an answer slower than 1 s.
    Once a second it also reads the admission limit from /metrics."""

    def __init__(self, url: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.stop = url, stop
        self.checks = self.misses = 0
        self.worst = 0.0
        self.limits: list[float] = []

    def run(self) -> None:
        with httpx.Client(timeout=1.0) as client:
            while not self.stop.wait(0.1):
                if self.checks % 10 == 9:
                    try:
                        self.limits.append(metric(self.url, "admission_limit"))
                    except httpx.HTTPError:
                        pass
                t0 = time.perf_counter()
                try:
                    ok = client.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                dt = time.perf_counter() - t0
                self.worst = max(self.worst, dt)
                self.checks += 1
                self.misses += (not ok) or dt > 1.0


class Burners:
    """``n`` processes that each keep one core busy (a Python busy loop), as autocannon and
    the 429 path do during the spike, without any HTTP traffic."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Burners:
        code = "while True: pass"
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(self.n)]
        time.sleep(0.5)  # let the scheduler see them
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def run_autocannon(
    tool: str, url: str, body: dict, rate: int, duration: int, connections: int, workers: int
) -> dict:
    cmd = [
        tool,
        *(["-w", str(workers)] if workers else []),
        "-c", str(connections),
        "-d", str(duration),
        "-R", str(rate),
        "-t", "30",
        "-C",  # raw latencies: see "Latency" in the module docstring
        "-m", "POST",
        "-H", "content-type=application/json",
        "-b", json.dumps(body),
        "-j",
        url + "/v1/completions",
    ]  # fmt: skip
    print("load:", " ".join(cmd[:-4]), "...", flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 120)
    return json.loads(out.stdout)


def drain(url: str, timeout: float = 300) -> float:
    """Wait until no request runs or waits; returns the KV blocks still in use."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        busy = metric(url, "num_requests_running") + metric(url, "num_requests_waiting")
        if busy == 0:
            break
        time.sleep(0.5)
    return metric(url, "kv_blocks_used")


def spike(args: argparse.Namespace, url: str, server: psutil.Process) -> dict:
    """Baseline probes, then the spike with probes and the health pinger."""
    tool = find_autocannon()
    name = model_name(url)
    probe_body = {  # exactly 32 tokens each: latencies of equal work
        "model": name,
        "prompt": "Tell me about the sea.",
        "max_tokens": 32,
        "ignore_eos": True,
    }
    load_body = {"model": name, "prompt": "hi", "max_tokens": 16}
    base = Probe(url, probe_body, threading.Event(), count=args.baseline_probes)
    base.run()
    burnt = Probe(url, probe_body, threading.Event(), count=args.baseline_probes)
    if args.burn_cores:
        with Burners(args.burn_cores):
            burnt.run()
    rss_before = rss_mib(server)
    stop = threading.Event()
    probes = [Probe(url, probe_body, stop) for _ in range(args.probes)]
    pinger = HealthPinger(url, stop)
    for t in (*probes, pinger):
        t.start()
    cpu0 = server.cpu_times()
    rejected0 = metric(url, "admission_rejections_total")
    tokens0 = metric(url, "generation_tokens_total", "vllm:")
    t0 = time.perf_counter()
    result = run_autocannon(
        tool, url, load_body, args.rate, args.duration, args.connections, args.workers
    )
    wall = time.perf_counter() - t0
    cpu1 = server.cpu_times()
    tokens = metric(url, "generation_tokens_total", "vllm:") - tokens0
    stop.set()
    for t in (*probes, pinger):
        t.join(130)
    return {
        "result": result,
        "wall": wall,
        "tokens_per_s": tokens / wall,
        "cpu_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
        "base": base.latencies,
        "burnt": burnt.latencies,
        "burn_cores": args.burn_cores,
        "spike": [x for p in probes for x in p.latencies],
        "base_ttft": base.ttfts,
        "spike_ttft": [x for p in probes for x in p.ttfts],
        "probe_errors": [e for p in probes for e in p.errors],
        "pinger": pinger,
        "rss_before": rss_before,
        "gate_rejections": metric(url, "admission_rejections_total") - rejected0,
    }


def report(r: dict, used_after: float, rss_after: tuple[float, float]) -> None:
    res, pinger = r["result"], r["pinger"]
    codes = res.get("statusCodeStats", {})
    n429 = codes.get("429", {}).get("count", 0)
    total = sum(v.get("count", 0) for v in codes.values())
    n5xx = sum(v["count"] for k, v in codes.items() if k.startswith("5"))
    lat = res["latency"]
    cpu_429_us = r["cpu_s"] / max(n429, 1) * 1e6
    base_med = statistics.median(r["base"]) if r["base"] else float("nan")
    spike_med = statistics.median(r["spike"]) if r["spike"] else float("nan")
    rows = [
        ("responses/s", f"{total / max(res['duration'], 1e-9):.0f}", ""),
        ("status codes", json.dumps({k: v["count"] for k, v in sorted(codes.items())}), ""),
        ("5xx", n5xx, "target 0"),
        ("connection errors / timeouts", f"{res['errors']} / {res['timeouts']}", "target 0"),
        ("429 share of responses", f"{n429 / max(total, 1):.4f}", ""),
        ("response latency p50 / p99 (ms)", f"{lat['p50']} / {lat['p99']}", "429 p99 <= 250"),
        ("response latency p99.9 / max (ms)", f"{lat['p99_9']} / {lat['max']}", ""),
        ("front-door CPU per 429 (us)", f"{cpu_429_us:.0f}", "target <= 100"),
        ("probe median alone (s)", f"{base_med:.3f} (n={len(r['base'])})", ""),
        ("probe median in spike (s)", f"{spike_med:.3f} (n={len(r['spike'])})", "<= 3x alone"),
        ("probe in spike min / quartiles / max", _quartiles(r["spike"]), ""),
        ("probe ratio spike/alone", f"{spike_med / base_med:.2f}", "target <= 3"),
        (
            f"probe median, {r['burn_cores']} core(s) burnt (s)",
            f"{_median(r['burnt']):.3f} (n={len(r['burnt'])})",
            "no HTTP load: CPU contention alone",
        ),
        (
            "probe ratio burnt/alone, spike/burnt",
            f"{_median(r['burnt']) / base_med:.2f} / {spike_med / _median(r['burnt']):.2f}",
            "the cores' share / the spike's own",
        ),
        (
            "probe first token alone / in spike (s)",
            f"{_median(r['base_ttft']):.3f} / {_median(r['spike_ttft']):.3f}",
            "",
        ),
        ("accepted tokens/s in the spike", f"{r['tokens_per_s']:.0f}", "load and probes"),
        ("probe errors", len(r["probe_errors"]), "target 0"),
        ("/health misses (of checks)", f"{pinger.misses} ({pinger.checks})", "target 0"),
        ("/health worst (s)", f"{pinger.worst:.3f}", ""),
        ("admission limit min / median / max", _spread(pinger.limits), ""),
        ("RSS http/engine before (MiB)", "{:.0f} / {:.0f}".format(*r["rss_before"]), ""),
        ("RSS http/engine after (MiB)", "{:.0f} / {:.0f}".format(*rss_after), ""),
        ("KV blocks used after drain", f"{used_after:.0f}", "target 0"),
    ]
    for name, value, target in rows:
        print(f"{name:34s} {value!s:>28s}  {target}")
    for e in r["probe_errors"][:5]:
        print("probe error:", e)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _quartiles(xs: list[float]) -> str:
    if len(xs) < 2:
        return "-"
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return f"{min(xs):.2f} / {q1:.2f} {q2:.2f} {q3:.2f} / {max(xs):.2f}"


def _spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{min(xs):.0f} / {statistics.median(xs):.0f} / {max(xs):.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=14720, help="requests/s offered")
    ap.add_argument("--duration", type=int, default=15, help="seconds of spike")
    ap.add_argument("--connections", type=int, default=1024)
    ap.add_argument(
        "--workers", type=int, default=0, help="autocannon worker threads (-w); 0: its main thread"
    )
    ap.add_argument(
        "--probes",
        type=int,
        default=4,
        help="patient probe clients, each one sample a spike (see 'Probes' in the module doc)",
    )
    ap.add_argument("--baseline-probes", type=int, default=5)
    ap.add_argument(
        "--burn-cores",
        type=int,
        default=1,
        help="busy-loop processes beside the idle server for a second baseline (the probe's "
        "time under CPU contention without HTTP load; 0: skip)",
    )
    ap.add_argument("--model", default=None, help="passed to pagewarden serve")
    ap.add_argument("--serve-args", default="", help="more flags for pagewarden serve, one string")
    args = ap.parse_args()
    extra = (["--model", args.model] if args.model else []) + args.serve_args.split()
    print(f"uptime: {os.popen('uptime').read().strip()}")
    proc, url = start_server(extra)
    try:
        server = psutil.Process(proc.pid)
        r = spike(args, url, server)
        used_after = drain(url)
        report(r, used_after, rss_mib(server))
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
