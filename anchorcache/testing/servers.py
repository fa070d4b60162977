"""Real worker and proxy processes on free ports, for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anchorcache.cli import free_port, wait_ready

if TYPE_CHECKING:
    import httpx


@dataclass
class Endpoint:
    """A server the tests reach by URL, in this process or another."""

    url: str


@dataclass
class Server(Endpoint):
    """A server in a process of its own, which a test may stop or kill."""

    proc: subprocess.Popen

    def kill(self) -> None:
        """SIGKILL the process and whatever of its session is left (SGLang's children)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        # children left in the session (SGLang's scheduler and detokenizer) go with it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def _spawn(args: list[str], port: int, env: dict[str, str] | None, *, tail: tuple[str, ...] = (),
           timeout_s: float = 300) -> Server:
    cmd = [sys.executable, "-m", "anchorcache.cli", *args, "--port", str(port), "--log-level", "warning",
           *tail]
    proc = subprocess.Popen(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
                            start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc)
    try:
        wait_ready(server.url + "/health", proc, timeout_s=timeout_s)
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


# SGLang's KV pool for the tests: restored prefixes may lock half of it (8 conversations: ~3k tokens)
SGLANG_TEST_ARGS = ("--max-total-tokens", "10000")


@contextmanager
def sglang_worker_process(*extra: str, model: str, anchor_slots: int = 64,
                          port: int | None = None, env: dict[str, str] | None = None
                          ) -> Iterator[Server]:
    """SGLang 0.5.23 with the anchorcache plugin (CPU recipe applied by the CLI); `extra`
    goes to SGLang verbatim. Start-up takes 25-70 s on an idle 2-core machine."""
    args = ["worker", "--backend", "sglang", "--model", model, "--anchor-slots", str(anchor_slots),
            "--fault-injection"]
    server = _spawn(args, port or free_port(), env, tail=("--", *SGLANG_TEST_ARGS, *extra),
                    timeout_s=900)
    try:
        yield server
    finally:
        # killed, not stopped: SGLang's SIGTERM watcher looks every 5 s (a stop took 7-9 s),
        # and a test server's state is all temporary
        server.kill()


def kill_tree(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """SIGKILL `proc` and every process below it (a `serve` and its worker), then reap it."""
    import psutil

    if proc.poll() is None:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
    proc.wait(timeout=timeout_s)


ADMIN_TOKEN = "test-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}  # the headers of an admin request


@contextmanager
def proxy_process(worker_url: str | list[str], *extra: str, env: dict[str, str] | None = None,
                  state_dir: str | None = None, port: int | None = None) -> Iterator[Server]:
    """A proxy with its own ledger (a fresh temporary one unless `state_dir` is given) and
    the admin API on (token `ADMIN_TOKEN`), in front of one worker or several; one process
    unless `extra` says `--processes N` (tests/test_processes.py)."""
    urls = [worker_url] if isinstance(worker_url, str) else worker_url
    with contextlib.ExitStack() as stack:
        if state_dir is None:
            state_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="anchorcache-state-"))
        env = {"ANCHORCACHE_ADMIN_TOKEN": ADMIN_TOKEN, "ANCHORCACHE_PROCESSES": "1",
               **(env or {})}
        workers = [arg for url in urls for arg in ("--worker", url)]
        server = _spawn(["proxy", *workers, "--state-dir", state_dir, *extra],
                        port or free_port(), env)
        try:
            yield server
        finally:
            server.stop()


def tenant_key(proxy: Endpoint, name: str) -> str:
    """A new tenant on `proxy` (through its admin API) and that tenant's API key."""
    import httpx

    reply = httpx.post(proxy.url + "/admin/tenants", json={"name": name},
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    reply.raise_for_status()
    return reply.json()["api_key"]


def admin(proxy: Endpoint, path: str, method: str = "GET", **kw: Any) -> Any:
    """An admin API call (`kw` goes to httpx) that must succeed; its JSON reply."""
    import httpx

    resp = httpx.request(method, proxy.url + path, headers=ADMIN, timeout=300, **kw)
    assert resp.status_code == 200, resp.text
    return resp.json()


PROCESS_HEADER = "X-Anchorcache-Process"  # (proxy/app.py's)


def process_client(proxy: Endpoint, index: int) -> httpx.Client:
    """A client whose one connection process `index` of a `--processes N` proxy serves: the
    kernel picks the process per connection (SO_REUSEPORT), so connections are opened until
    one lands there (`X-Anchorcache-Process`)."""
    import httpx

    for _ in range(200):
        client = httpx.Client(base_url=proxy.url, timeout=300,
                              limits=httpx.Limits(max_connections=1))
        if client.get("/health").headers[PROCESS_HEADER] == str(index):
            return client
        client.close()
    raise AssertionError(f"no connection reached process {index}")


def ask(proxy: Endpoint, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
        client: httpx.Client | None = None, **kw: Any) -> tuple[dict[str, Any], str]:
    """A greedy 6-token chat completion as the anonymous tenant, on a new connection or
    `client`'s; (reply, the name of the worker that served it: `X-Anchorcache-Worker`)."""
    import httpx

    post = client.post if client is not None else httpx.post
    resp = post(proxy.url + "/v1/chat/completions", timeout=300, json={
        "model": "default", "messages": messages, "tools": tools, "temperature": 0,
        "max_tokens": 6, **kw})
    assert resp.status_code == 200, resp.text
    return resp.json(), resp.headers["X-Anchorcache-Worker"]
