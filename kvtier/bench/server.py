"""A real `kvtier serve` subprocess, for the benchmarks that drive real clients and for the tests: on a free port,
its output in a log file, stopped on exit."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

READY_LINE = "kvtier is ready"
ROOT = Path(__file__).resolve().parents[2]      # the checkout: where `python -m kvtier.cli` runs


class ServerFailed(RuntimeError):
    """The server exited or did not become ready; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def running_server(args: list[str], log_path, env: dict[str, str] | None = None, on_start=None,
                   ready_timeout_s: float = 300):
    """`kvtier serve` with args (the bundled model unless --model is given); yields its URL once it is healthy and
    has logged that it is ready. env: more environment variables; on_start(proc) is called once it is ready."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--port", str(port), *args],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not (_healthy(url) and READY_LINE in open(log_path).read()):   # the line follows uvicorn's start
            if proc.poll() is not None:
                raise ServerFailed(f"kvtier serve exited with {proc.returncode}:\n{open(log_path).read()[-3000:]}")
            if time.monotonic() > deadline:
                raise ServerFailed(f"kvtier serve did not become ready:\n{open(log_path).read()[-3000:]}")
            time.sleep(0.25)
        if on_start is not None:
            on_start(proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
