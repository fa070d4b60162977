"""Real worker and proxy processes on free ports, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from anchorcache.cli import free_port, wait_ready


@dataclass
class Server:
    url: str
    proc: subprocess.Popen

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


def _spawn(args: list[str], port: int, env: dict[str, str] | None) -> Server:
    cmd = [sys.executable, "-m", "anchorcache.cli", *args, "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
                            start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc)
    try:
        wait_ready(server.url + "/health", proc, timeout_s=300)
    except BaseException:
        server.kill()
        raise
    return server


@contextmanager
def worker_process(*extra: str, model: str | None = None, env: dict[str, str] | None = None,
                   threads: int = 2, port: int | None = None) -> Iterator[Server]:
    args = ["worker", "--threads", str(threads), "--fault-injection", *extra]
    if model:
        args += ["--model", model]
    server = _spawn(args, port or free_port(), env)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def proxy_process(worker_url: str, *extra: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    server = _spawn(["proxy", "--worker", worker_url, *extra], free_port(), env)
    try:
        yield server
    finally:
        server.stop()
