"""`anchorcache serve`'s supervisor (anchorcache/supervise.py) on a stand-in child: any
command line with a health URL, whatever the backend. Restarts with backoff, reports its
state, and the child dies with its parent even when the parent is SIGKILLed."""

from __future__ import annotations

import asyncio
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

HEALTH_SERVER = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")
FAST = SuperviseConfig(ready_timeout_s=30, backoff_initial_s=0.1, backoff_max_s=0.4,
                       stop_grace_s=5, poll_s=0.05)


def child(port: int) -> list[str]:
    return [sys.executable, "-c", HEALTH_SERVER, str(port)]


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
