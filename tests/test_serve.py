"""The README's main job: `anchorcache serve` answers the openai SDK and stops cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from anchorcache.cli import free_port, wait_ready

pytestmark = pytest.mark.slow


def test_serve_answers_and_stops_both_processes_on_sigterm(default_model_dir, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "anchorcache.cli", "serve", "--port", str(port),
                             "--threads", "2", "--log-level", "warning"],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                 "ANCHORCACHE_STATE_DIR": str(tmp_path)})
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout_s=300)
        # no key: the anonymous tenant (on by default on loopback)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="", max_retries=0)
        reply = client.chat.completions.create(
            model="default", temperature=0, max_tokens=20,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children  # the embedded worker
        # serve made a worker secret the proxy sends: without it the worker serves no one
        (worker_port,) = {c.laddr.port for child in children for c in child.net_connections()
                          if c.status == psutil.CONN_LISTEN}
        worker_url = f"http://127.0.0.1:{worker_port}"
        for path in ("/anchor/slots", "/model_info"):
            assert httpx.get(worker_url + path, timeout=30).status_code == 401
        assert httpx.post(worker_url + "/anchor/flush", timeout=30).status_code == 401
        assert httpx.get(worker_url + "/health", timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _gone, alive = psutil.wait_procs(children, timeout=30)
        assert alive == []
        assert f"http://127.0.0.1:{port}/v1" in proc.stdout.read()
        assert (tmp_path / "ledger.sqlite3").exists()
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- supervision --------------------------------------------------------------------------

LONG = [{"role": "user", "content": "Count from 1 to 500, one number per line."}]


@pytest.fixture(scope="module")
def serve_proc(default_model_dir, tmp_path_factory):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "anchorcache.cli", "serve", "--port", str(port),
                             "--threads", "2", "--log-level", "warning"],
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                 "ANCHORCACHE_STATE_DIR": str(tmp_path_factory.mktemp("state"))})
    proc.url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc.url + "/health", proc, timeout_s=300)
        yield proc
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            child.kill()
        if proc.poll() is None:
            proc.kill()


def _health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=30)


def test_a_killed_worker_is_restarted_and_its_anchors_forgotten(serve_proc):
    client = openai.OpenAI(base_url=serve_proc.url + "/v1", api_key="", max_retries=0, timeout=120)
    before = _health(serve_proc.url).json()
    assert before["worker_process"] == {"state": "running", "pid": before["worker_process"]["pid"],
                                        "restarts": 0, "last_exit_code": None,
                                        "last_restart_reason": None}
    worker = psutil.Process(before["worker_process"]["pid"])
    stream = client.chat.completions.create(model="default", messages=LONG, max_tokens=400,
                                            temperature=0, stream=True)
    seen = 0
    with pytest.raises(openai.APIError) as err:  # the request in flight: a clear error
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                seen += 1
                if seen == 3:
                    worker.kill()
    assert "worker" in str(err.value).lower()
    states = []
    deadline = time.monotonic() + 300
    while (resp := _health(serve_proc.url)).status_code != 200 and time.monotonic() < deadline:
        body = resp.json()
        assert resp.status_code == 503 and body["status"] == "degraded"
        states.append(body["worker_process"]["state"])
        time.sleep(0.2)
    assert resp.status_code == 200
    # seen degraded while it was down ("running" only until the supervisor saw the exit)
    assert "restarting" in states and set(states) <= {"running", "restarting"}
    after = resp.json()
    assert after["worker_process"]["restarts"] == 1
    assert after["worker_process"]["last_exit_code"] == -signal.SIGKILL
    assert after["worker_process"]["last_restart_reason"] == "exited"  # not killed by serve
    assert after["worker_process"]["pid"] != worker.pid
    assert after["worker"]["epoch"] != before["worker"]["epoch"]
    reply = client.chat.completions.create(model="default", temperature=0, max_tokens=20,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content


def test_sigkill_of_serve_leaves_no_process_and_frees_the_ports(serve_proc):
    worker_pid = _health(serve_proc.url).json()["worker_process"]["pid"]
    worker_port = next(c.laddr.port for c in psutil.Process(worker_pid).net_connections()
                       if c.status == psutil.CONN_LISTEN)
    family = psutil.Process(serve_proc.pid).children(recursive=True)
    assert worker_pid in {p.pid for p in family}
    serve_proc.send_signal(signal.SIGKILL)
    serve_proc.wait(timeout=30)
    _gone, alive = psutil.wait_procs(family, timeout=30)
    assert alive == []
    for port in (worker_port, int(serve_proc.url.rsplit(":", 1)[1])):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))  # free


def test_the_embedded_worker_refuses_a_sliding_window_model_in_one_line():
    """Its cache layer cannot snapshot a sliding layer (transformers keeps only the window):
    a one-line error naming the SGLang worker, exit 2, no traceback."""
    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir

    model = build_tiny_model("granite_swa", tiny_model_dir("granite_swa"))
    proc = subprocess.run([sys.executable, "-m", "anchorcache.cli", "worker", "--port",
                           str(free_port()), "--model", str(model)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "sliding-window layer" in proc.stderr and "--backend sglang" in proc.stderr
    assert "Traceback" not in proc.stderr
