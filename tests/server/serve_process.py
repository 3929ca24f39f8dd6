"""A real ``pagewarden serve`` on the default model, for the structured-outputs, tools and
Responses tests (clients we did not write talk to it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
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
        # A file, not a pipe: nobody reads the log while tests run, and a full pipe
        # would block the server.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagewarden-serve-", suffix=".log")
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
            stdout=self.log,
            stderr=subprocess.STDOUT,
            # The C++ kernels are not under test here; their first build takes minutes.
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PAGEWARDEN_NO_CPU_EXT": "1"},
        )
        deadline = time.time() + 600
        while time.time() < deadline and self.proc.poll() is None:
            if "serving" in self.output() and self.url in self.output():
                break
            time.sleep(0.5)
        else:
            self.stop()
            raise RuntimeError(f"pagewarden serve did not start: {self.output()[-2000:]}")
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def output(self) -> str:
        """Everything the server printed so far."""
        with open(self.log.name) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
