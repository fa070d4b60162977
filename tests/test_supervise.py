"""`anchorcache serve`'s supervisor (anchorcache/supervise.py) on a stand-in child: any
command line with a health URL, whatever the backend. Restarts with backoff, reports its
state, restarts a child that is alive but hung (no health answer, or no progress while it
holds requests), and the child dies with its parent even when the parent is SIGKILLed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import psutil
import pytest

from anchorcache.cli import free_port
from anchorcache.supervise import SuperviseConfig, Supervisor, WorkerExited

# answers every GET with argv[2] (default "ok"); appends a line to argv[3] per GET if given
HEALTH_SERVER = textwrap.dedent("""
    import http.server, sys
    body = (sys.argv[2] if len(sys.argv) > 2 else "ok").encode()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(body)
            if len(sys.argv) > 3:
                with open(sys.argv[3], "a") as f:
                    f.write("get\\n")
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")
FAST = SuperviseConfig(ready_timeout_s=30, backoff_initial_s=0.1, backoff_max_s=0.4,
                       stop_grace_s=5, poll_s=0.05, health_interval_s=0.05)
HOLDING = json.dumps({"status": "ok", "running_requests": ["r1"], "queued_requests": []})
IDLE = json.dumps({"status": "ok", "running_requests": [], "queued_requests": []})


def child(port: int, body: str = "ok", log: str | None = None) -> list[str]:
    return [sys.executable, "-c", HEALTH_SERVER, str(port), body, *([log] if log else [])]


async def _until(predicate, timeout_s: float = 30) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def test_a_killed_child_is_restarted_and_stopped_with_its_group():
    port = free_port()
    readies = []

    async def on_ready() -> None:
        readies.append(sup.status().pid)

    sup = Supervisor(child(port), f"http://127.0.0.1:{port}/health", FAST, on_ready=on_ready)
    await sup.start()
    first = sup.status()
    assert first.state == "running" and first.restarts == 0 and first.pid is not None
    os.kill(first.pid, signal.SIGKILL)
    await _until(lambda: sup.status().state != "running")
    assert sup.status().state == "restarting"
    await _until(lambda: sup.status().state == "running")
    second = sup.status()
    assert second.restarts == 1 and second.last_exit_code == -signal.SIGKILL
    assert second.pid != first.pid and readies == [second.pid]
    await sup.stop()
    assert sup.status().state == "stopped"
    assert not psutil.pid_exists(second.pid) or psutil.Process(second.pid).status() == "zombie"


async def test_a_child_that_never_gets_healthy_fails_the_start():
    sup = Supervisor([sys.executable, "-c", "import sys; sys.exit(3)"],
                     f"http://127.0.0.1:{free_port()}/health", FAST)
    with pytest.raises(WorkerExited, match="exited with 3"):
        await sup.start()


PARENT = textwrap.dedent("""
    import asyncio, sys
    from anchorcache.supervise import Supervisor
    async def main():
        sup = Supervisor(sys.argv[2:], f"http://127.0.0.1:{sys.argv[1]}/health")
        await sup.start()
        print(sup.status().pid, flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
""")


def test_the_child_dies_with_a_sigkilled_parent():
    port = free_port()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(port), *child(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        worker = psutil.Process(pid)
        assert worker.ppid() == parent.pid
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        worker.wait(timeout=10)  # PR_SET_PDEATHSIG
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    finally:
        if parent.poll() is None:
            parent.kill()


# ---- hung children -------------------------------------------------------------------------

async def test_a_stopped_child_is_killed_and_restarted_as_unresponsive():
    port = free_port()
    config = dataclasses.replace(FAST, health_timeout_s=1.0)
    sup = Supervisor(child(port), f"http://127.0.0.1:{port}/health", config)
    await sup.start()
    first = sup.status().pid
    os.kill(first, signal.SIGSTOP)  # alive, answers nothing
    try:
        await _until(lambda: sup.status().restarts == 1 and sup.status().state == "running")
        status = sup.status()
        assert status.last_restart_reason == "unresponsive"
        assert status.last_exit_code == -signal.SIGKILL and status.pid != first
        assert not psutil.pid_exists(first) or psutil.Process(first).status() == "zombie"
    finally:
        await sup.stop()


async def test_a_child_holding_requests_without_progress_is_restarted_as_stalled():
    port = free_port()
    stalled: dict[str, float | None] = {"s": None}

    async def on_ready() -> None:  # the held requests ended with the old worker
        stalled["s"] = None

    sup = Supervisor(child(port, HOLDING), f"http://127.0.0.1:{port}/health",
                     dataclasses.replace(FAST, stall_timeout_s=5.0),
                     stalled_s=lambda: stalled["s"], on_ready=on_ready)
    await sup.start()
    first = sup.status().pid
    stalled["s"] = 6.0
    try:
        await _until(lambda: sup.status().restarts == 1 and sup.status().state == "running")
        assert sup.status().last_restart_reason == "stalled"
        assert sup.status().pid != first
    finally:
        await sup.stop()


async def test_no_restart_while_the_child_holds_nothing_or_makes_progress(tmp_path):
    """The proxy's clock says stalled, but the worker lists no request (a leaked counter):
    left alone; a worker that holds requests and progresses is left alone too."""
    for body, stalled in ((IDLE, 3600.0), (HOLDING, 1.0)):
        port = free_port()
        log = tmp_path / f"gets-{port}"
        sup = Supervisor(child(port, body, str(log)), f"http://127.0.0.1:{port}/health",
                         dataclasses.replace(FAST, stall_timeout_s=2.0, health_timeout_s=2.0),
                         stalled_s=lambda s=stalled: s)
        await sup.start()
        try:
            await _until(lambda log=log: log.exists() and len(log.read_text().split()) >= 40)
            assert sup.status().state == "running" and sup.status().restarts == 0
        finally:
            await sup.stop()


def test_the_watch_settings_are_checked():
    with pytest.raises(ValueError, match="health_timeout_s"):
        SuperviseConfig(health_timeout_s=0)
    with pytest.raises(ValueError, match="stall_timeout_s"):
        SuperviseConfig(stall_timeout_s=-1)
    assert SuperviseConfig(health_timeout_s=None, stall_timeout_s=None).health_interval_s > 0
