"""A worker that is alive but stuck: `anchorcache serve` restarts it, and the
requests it held end with a clean error (an OpenAI error body, or an in-band SSE error),
never a hang. Embedded worker: the engine thread wedged by the fault hook (its HTTP side
keeps answering: only the missing progress tells), and the whole process SIGSTOPped (no
health answer). SGLang: its scheduler SIGSTOPped (its HTTP side keeps answering)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import openai
import psutil
import pytest

from anchorcache.cli import free_port, wait_ready
from anchorcache.testing.servers import kill_tree

pytestmark = pytest.mark.slow

LONG = [{"role": "user", "content": "Count from 1 to 500, one number per line."}]
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
# the worker secret serve shares with its worker (serve makes one unless given one): the
# tests call the worker directly with it
SECRET = "serve-hang-worker-secret-0123"
WORKER_AUTH = {"Authorization": f"Bearer {SECRET}"}


@dataclass
class Serve:
    url: str
    proc: subprocess.Popen

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=60)

    def worker(self) -> tuple[psutil.Process, str]:
        """The worker process `serve` supervises, and its URL."""
        pid = self.health().json()["worker_process"]["pid"]
        worker = psutil.Process(pid)
        port = next(c.laddr.port for c in worker.net_connections() if c.status == psutil.CONN_LISTEN)
        return worker, f"http://127.0.0.1:{port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="", max_retries=0, timeout=600)


@contextmanager
def _serve(*args: str, env: dict[str, str] | None = None, timeout_s: float = 300) -> Iterator[Serve]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "anchorcache.cli", "serve", "--port", str(port),
                             "--log-level", "warning", *args],
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                 "ANCHORCACHE_WORKER_SECRET": SECRET, **(env or {})})
    serve = Serve(f"http://127.0.0.1:{port}", proc)
    try:
        wait_ready(serve.url + "/health", proc, timeout_s=timeout_s)
        yield serve
    finally:
        kill_tree(proc)


@dataclass
class Held:
    """One request sent through the proxy on its own thread, and how it ended."""

    stream: bool
    chunks: int = 0  # streamed chunks with text, before the error
    status: int | None = None  # non-streaming: the HTTP status
    body: dict | None = None  # non-streaming: the JSON body
    error: BaseException | None = None  # streaming: what the SDK raised
    done: threading.Event = field(default_factory=threading.Event)


def _send(serve: Serve, held: Held, messages: list[dict], max_tokens: int) -> None:
    try:
        if held.stream:
            # an error before the first chunk is the status of the reply, after it an SSE
            # error event: the SDK raises either
            try:
                stream = serve.client().chat.completions.create(
                    model="default", messages=messages, max_tokens=max_tokens, temperature=0,
                    stream=True)
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        held.chunks += 1
            except openai.APIError as e:
                held.error = e
        else:
            resp = httpx.post(serve.url + "/v1/chat/completions", timeout=600, json={
                "model": "default", "messages": messages, "max_tokens": max_tokens,
                "temperature": 0})
            held.status, held.body = resp.status_code, resp.json()
    finally:
        held.done.set()


def _start(serve: Serve, stream: bool, messages: list[dict] = LONG, max_tokens: int = 400) -> Held:
    held = Held(stream)
    threading.Thread(target=_send, args=(serve, held, messages, max_tokens), daemon=True).start()
    return held


def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not reached in {timeout_s:.0f} s: {what}")


def _assert_clean_error(held: Held) -> None:
    assert held.done.wait(timeout=600), "the request hangs"
    if held.stream:
        assert isinstance(held.error, openai.APIError), held.error
        assert "worker" in str(held.error).lower()
        if isinstance(held.error, openai.APIStatusError):  # before the first chunk
            assert held.error.status_code in (502, 503)
    else:  # an OpenAI error body with a 5xx the proxy chose, not a crash
        assert held.status in (502, 503), (held.status, held.body)
        error = held.body["error"]
        assert error["type"] == "server_error" and error["code"] in ("worker_error",
                                                                      "worker_unavailable")
        assert "worker" in error["message"].lower()


def _restarted(serve: Serve, before: dict, restarts: int, reason: str, timeout_s: float) -> dict:
    """Wait until `serve` reports the worker restarted `restarts` times and healthy again."""
    def healthy() -> bool:
        resp = serve.health()
        return resp.status_code == 200 and resp.json()["worker_process"]["restarts"] == restarts

    _until(healthy, timeout_s, f"restart {restarts} ({reason})")
    after = serve.health().json()
    process = after["worker_process"]
    assert process["last_restart_reason"] == reason
    assert process["last_exit_code"] == -signal.SIGKILL
    assert process["pid"] != before["worker_process"]["pid"]
    assert after["worker"]["epoch"] != before["worker"]["epoch"]
    return after


def _answers(serve: Serve) -> str:
    reply = serve.client().chat.completions.create(model="default", messages=PARIS,
                                                   max_tokens=20, temperature=0)
    return reply.choices[0].message.content or ""


# ---- the embedded worker ---------------------------------------------------------------------

WATCH = ("--worker-health-timeout-s", "15", "--worker-stall-timeout-s", "15")


@pytest.fixture(scope="module")
def embedded_serve(default_model_dir, tmp_path_factory) -> Iterator[Serve]:
    state = str(tmp_path_factory.mktemp("state"))
    with _serve("--threads", "2", *WATCH,
                env={"ANCHORCACHE_FAULT_INJECTION": "1", "ANCHORCACHE_STATE_DIR": state}) as serve:
        yield serve


def _worker_holds(worker_url: str, running: int, queued: int) -> Callable[[], bool]:
    def check() -> bool:
        body = httpx.get(worker_url + "/health", timeout=30).json()
        return len(body["running_requests"]) >= running and len(body["queued_requests"]) >= queued
    return check


def test_a_wedged_engine_is_restarted_and_its_requests_end_cleanly(embedded_serve):
    serve = embedded_serve
    before = serve.health().json()
    _, worker_url = serve.worker()
    armed = httpx.post(worker_url + "/debug/fault", json={"where": "decode", "hang": True},
                       headers=WORKER_AUTH, timeout=30)
    assert armed.json() == {"armed": "decode", "hang": True}
    streamed = _start(serve, stream=True)  # wedges the engine after its first token
    _until(_worker_holds(worker_url, 1, 0), 300, "the worker runs the streamed request")
    # waits behind it in the worker (its own system prompt: it does not wait in the proxy for
    # the instruction anchor the first one writes)
    queued = _start(serve, stream=False, messages=[{"role": "system", "content": "Be brief."},
                                                   *PARIS])
    # the worker's HTTP side still answers and lists both: only the missing progress tells
    _until(_worker_holds(worker_url, 1, 1), 300, "the worker queues the second request")
    _assert_clean_error(streamed)
    _assert_clean_error(queued)
    restarts = before["worker_process"]["restarts"] + 1
    _restarted(serve, before, restarts, "stalled", timeout_s=300)
    assert "Paris" in _answers(serve)


def test_a_stopped_worker_is_restarted_and_its_requests_end_cleanly(embedded_serve):
    serve = embedded_serve
    before = serve.health().json()
    worker, _ = serve.worker()
    streamed = _start(serve, stream=True)
    _until(lambda: streamed.chunks >= 3 or streamed.done.is_set(), 300, "three streamed chunks")
    assert not streamed.done.is_set()
    worker.suspend()  # SIGSTOP: answers nothing, not even /health
    late = _start(serve, stream=False)  # sent to the stopped worker
    _assert_clean_error(streamed)
    _assert_clean_error(late)
    restarts = before["worker_process"]["restarts"] + 1
    _restarted(serve, before, restarts, "unresponsive", timeout_s=300)
    assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE
    assert "Paris" in _answers(serve)


# ---- SGLang ----------------------------------------------------------------------------------

def _scheduler(worker: psutil.Process) -> psutil.Process:
    """SGLang's scheduler: the child of its HTTP process that runs the model."""
    for child in worker.children(recursive=True):
        if "scheduler" in (child.name() + " " + " ".join(child.cmdline())).lower():
            return child
    raise AssertionError(f"no scheduler among {[c.name() for c in worker.children()]}")


def test_a_stopped_sglang_scheduler_is_restarted(tmp_path):
    """SGLang's scheduler stopped: the HTTP side answers health checks, nothing progresses;
    the held requests end cleanly and the restarted worker answers. (A process that answers
    no health check at all is the embedded SIGSTOP case above; each SGLang start costs
    25-70 s, so it is not repeated here.)"""
    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir

    model = str(build_tiny_model("qwen3", tiny_model_dir("qwen3")))
    with _serve("--backend", "sglang", "--model", model, "--worker-health-timeout-s", "10",
                "--worker-stall-timeout-s", "10", "--", "--max-total-tokens", "10000",
                env={"ANCHORCACHE_STATE_DIR": str(tmp_path)}, timeout_s=900) as serve:
        before = serve.health().json()
        worker, worker_url = serve.worker()
        # the worker secret is SGLang's API key: our routes and SGLang's own need it
        for path in ("/anchor/slots", "/get_model_info", "/v1/models"):
            assert httpx.get(worker_url + path, timeout=30).status_code == 401, path
            assert httpx.get(worker_url + path, headers=WORKER_AUTH, timeout=30).status_code \
                == 200, path
        assert httpx.post(worker_url + "/anchor/flush", timeout=30).status_code == 401
        assert httpx.get(worker_url + "/health", timeout=30).status_code == 200
        stopped = _scheduler(worker)
        stopped.suspend()
        held = [_start(serve, stream=True, max_tokens=64),
                _start(serve, stream=False, max_tokens=64)]
        for request in held:
            _assert_clean_error(request)
        _restarted(serve, before, before["worker_process"]["restarts"] + 1, "stalled",
                   timeout_s=900)
        assert not psutil.pid_exists(stopped.pid) or stopped.status() == psutil.STATUS_ZOMBIE
        reply = serve.client().chat.completions.create(
            model="default", messages=PARIS, max_tokens=8, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
