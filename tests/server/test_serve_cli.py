"""``pagewarden serve`` as a real process: ready line, a request, clean SIGTERM/SIGINT."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_ready_request_and_clean_shutdown(tiny_llama_dir, sig):
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagewarden",
            "serve",
            "--model",
            str(tiny_llama_dir),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "32",
            "--max-model-len",
            "128",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = ""
        deadline = time.time() + 120
        while "serving" not in line and time.time() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}" in line, line
        name = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": name, "prompt": "hi", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        # A stream in flight when the signal arrives must not keep the process alive.
        with httpx.stream(
            "POST",
            f"http://127.0.0.1:{port}/v1/completions",
            json={
                "model": name,
                "prompt": "hi",
                "max_tokens": 100,
                "stream": True,
                "ignore_eos": True,
            },
            timeout=60,
        ) as s:
            next(s.iter_lines())
            proc.send_signal(sig)
            assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
