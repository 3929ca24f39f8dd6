"""A real ``pagewarden serve`` on the default model, for the structured-outputs, tools and
Responses tests (clients we did not write talk to it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``pagewarden serve`` with the default model, started and stopped by a fixture."""

    def __init__(self, *extra: str) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagewarden",
                "serve",
                "--port",
                str(port),
                "--num-kv-blocks",
                "640",
                "--max-model-len",
                "4096",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        line, deadline = "", time.time() + 600
        while "serving" not in line and time.time() < deadline and self.proc.poll() is None:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if self.url not in line:
            self.stop()
            raise RuntimeError(f"pagewarden serve did not start: {line!r}")
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
