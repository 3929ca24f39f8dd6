"""Serving side by side: vLLM's own client (`vllm bench serve`) against `pagewarden serve`
and `vllm serve`, same random dataset, same machine, one after the other.

    python bench/serve.py --vllm-python /work/venvs/vllm/bin/python \\
        --vllm-model /work/venvs/smollm2-hf            # 96 x 128/128, concurrency 32
    python bench/serve.py --vllm-python ... --vllm-model ... --rounds 2 --num-prompts 48

The client is vLLM's public benchmark (`vllm.benchmarks.serve`, run from the vLLM venv:
its console script needs a `vllm` distribution the CPU wheel does not provide, so it is
called as a module function). Each server starts fresh on loopback, is warmed up with a
few requests, serves the client's run, and stops; with ``--rounds`` > 1 the servers
alternate. pagewarden runs with default flags (bf16 where the CPU has bf16 GEMMs,
integrity standard, admission control on); vLLM runs tuned as ``docs/peers.md``
describes (tcmalloc and Intel OpenMP preloaded, threads bound, 2 GiB of KV, prefix
caching off, like ours for this random workload). Prints output tok/s, TTFT and
inter-token latency medians and p99 for each, medians over rounds, and the ratios.
Note ``uptime`` beside the figures: the load generator shares the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METRICS = (
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_itl_ms", "ITL p50 ms"),
    ("p99_itl_ms", "ITL p99 ms"),
)

CLIENT = """
import sys
from vllm.benchmarks import serve
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
serve.add_cli_args(parser)
serve.main(parser.parse_args(sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server on port {port} not ready after {timeout} s")


def _tcmalloc() -> str | None:
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        p = Path(d) / "libtcmalloc_minimal.so.4"
        if p.exists():
            return str(p)
    return None


def _server_cmd(name: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if name == "pagewarden":
        cmd = [sys.executable, "-m", "pagewarden", "serve", "--port", str(port)]
        # bf16 weights as vLLM's HF folder (a --quantization in --pagewarden-args wins)
        cmd += ["--served-model-name", "bench-model", "--quantization", "none"]
        cmd += args.pagewarden_args
        if args.model:
            cmd += ["--model", args.model]
        env["PYTHONPATH"] = str(ROOT)
        return cmd, env
    venv = Path(args.vllm_python).parent.parent
    preload = [p for p in (_tcmalloc(), str(venv / "lib" / "libiomp5.so")) if Path(p).exists()]
    env.update(
        LD_PRELOAD=":".join(preload),
        VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 2) - 1}",
        VLLM_CPU_KVCACHE_SPACE="2",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
    )
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--port", str(port)]
    cmd += ["--model", args.vllm_model, "--served-model-name", "bench-model"]
    cmd += ["--dtype", args.vllm_dtype, "--no-enable-prefix-caching", "--max-model-len", "2048"]
    return cmd, env


def _run_client(args: argparse.Namespace, port: int, result_dir: str, tag: str) -> dict:
    name = f"{tag}.json"
    cmd = [args.vllm_python, "-c", CLIENT, "--backend", "openai", "--endpoint", "/v1/completions"]
    cmd += ["--base-url", f"http://127.0.0.1:{port}", "--model", "bench-model"]
    cmd += ["--tokenizer", args.vllm_model, "--dataset-name", "random"]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd += ["--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency)]
    cmd += ["--ignore-eos", "--seed", "0", "--num-warmups", "2"]
    cmd += ["--save-result", "--result-dir", result_dir, "--result-filename", name]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(
            f"client failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    with open(Path(result_dir) / name) as f:
        result = json.load(f)
    if result.get("failed"):
        print(f"  warning: {result['failed']} request(s) failed", flush=True)
    return result


def _serve_once(name: str, args: argparse.Namespace, result_dir: str, r: int) -> dict:
    port = _free_port()
    cmd, env = _server_cmd(name, args, port)
    log = open(Path(result_dir) / f"{name}-{r}.log", "w")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        _wait_ready(port, proc)
        return _run_client(args, port, result_dir, f"{name}-{r}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu")
    ap.add_argument("--vllm-model", required=True, help="HF folder of the same weights")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--model", default=None, help="pagewarden's model (default: SmolLM2 GGUF)")
    ap.add_argument("--pagewarden-args", nargs=argparse.REMAINDER, default=[])
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--engines", nargs="+", default=["pagewarden", "vllm"])
    ap.add_argument("--keep", action="store_true", help="keep the result folder (logs, JSON)")
    args = ap.parse_args()
    print(f"uptime: {os.popen('uptime').read().strip()}", flush=True)
    result_dir = tempfile.mkdtemp(prefix="pagewarden-serve-bench-")
    results: dict[str, list[dict]] = {name: [] for name in args.engines}
    try:
        for r in range(args.rounds):
            order = args.engines if r % 2 == 0 else args.engines[::-1]
            for name in order:
                res = _serve_once(name, args, result_dir, r)
                results[name].append(res)
                figures = ", ".join(f"{label} {res[key]:.1f}" for key, label in METRICS)
                print(f"round {r + 1} {name:10s} {figures}", flush=True)
    finally:
        if args.keep:
            print(f"results and server logs in {result_dir}")
        else:
            shutil.rmtree(result_dir, ignore_errors=True)
    print(
        f"{args.num_prompts} x {args.input_len}/{args.output_len}, concurrency "
        f"{args.concurrency}, medians of {args.rounds} round(s):"
    )
    med = {
        name: {key: statistics.median(r[key] for r in rs) for key, _ in METRICS}
        for name, rs in results.items()
    }
    print(f"  {'':10s} " + " ".join(f"{label:>12s}" for _, label in METRICS))
    for name, m in med.items():
        print(f"  {name:10s} " + " ".join(f"{m[key]:12.1f}" for key, _ in METRICS))
    if "pagewarden" in med and "vllm" in med:
        p, v = med["pagewarden"], med["vllm"]
        print(
            f"  pagewarden / vllm: throughput {p['output_throughput'] / v['output_throughput']:.2f}x, "
            f"ITL p99 {p['p99_itl_ms'] / v['p99_itl_ms']:.2f}x (lower is better), "
            f"TTFT p50 {p['median_ttft_ms'] / v['median_ttft_ms']:.2f}x"
        )
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
