"""A real ``pagewarden serve`` with a disk tier, killed with SIGKILL (or stopped cleanly)
and started again on the same directory, serves the same tokens and loads the prefix from
the tier."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPTS = [[3 + (7 * i + j) % 400 for j in range(41)] for i in range(6)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model_dir: Path, offload_dir: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "pagewarden", "serve",
            "--model", str(model_dir),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--dtype", "float32",
            "--block-size", "4",
            "--num-kv-blocks", "24",
            "--max-num-seqs", "1",
            "--max-model-len", "128",
            "--kv-offload-dir", str(offload_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # its own process group: SIGKILL reaches the engine core too
    )  # fmt: skip
    line = ""
    deadline = time.time() + 600  # a loaded machine may build the C++ kernels first
    while "serving" not in line and time.time() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
    assert f"http://127.0.0.1:{port}" in line, line
    return proc


def _complete(port: int, prompt: list[int]) -> list[int]:
    url = f"http://127.0.0.1:{port}"
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": name,
            "prompt": prompt,
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _disk_hits(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    m = re.search(r'^pagewarden:kv_tier_hits_total\{[^}]*tier="disk"[^}]*\} (\S+)$', text, re.M)
    assert m is not None, "no disk tier hits metric"
    return float(m.group(1))


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_sigkill_and_restart_on_the_same_directory_sees_disk_hits(tiny_llama_dir, tmp_path):
    offload = tmp_path / "kv"
    port = _free_port()
    proc = _start(tiny_llama_dir, offload, port)
    try:
        first = [_complete(port, p) for p in PROMPTS]  # later prompts evict earlier ones
        deadline = time.time() + 30  # the writer thread stores off the step's path
        while time.time() < deadline and len(list(offload.rglob("*.kvb"))) < 10:
            time.sleep(0.1)
        assert len(list(offload.rglob("*.kvb"))) >= 10
    finally:
        _kill(proc)  # no clean shutdown: what is on disk is what a crash leaves
    port = _free_port()
    proc = _start(tiny_llama_dir, offload, port)
    try:
        assert _disk_hits(port) == 0
        assert _complete(port, PROMPTS[0]) == first[0]
        assert _disk_hits(port) >= 9  # 41 tokens: 10 blocks, the last one computed
    finally:
        _kill(proc)


def test_a_clean_stop_writes_the_pools_prefix_and_the_restart_hits(tiny_llama_dir, tmp_path):
    offload = tmp_path / "kv"
    port = _free_port()
    proc = _start(tiny_llama_dir, offload, port)
    try:
        first = _complete(port, PROMPTS[0])  # nothing evicted: its blocks are in the pool
        assert _disk_hits(port) == 0
        proc.send_signal(signal.SIGTERM)  # a graceful stop
        assert proc.wait(timeout=60) is not None
    finally:
        _kill(proc)
    assert len(list(offload.rglob("*.kvb"))) >= 10  # written at shutdown
    port = _free_port()
    proc = _start(tiny_llama_dir, offload, port)
    try:
        assert _complete(port, PROMPTS[0]) == first
        assert _disk_hits(port) >= 9
    finally:
        _kill(proc)
