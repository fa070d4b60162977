"""`anchorcache serve`'s worker supervision: one child process, given its command line.

The supervisor knows nothing of the backend: it starts `cmd`, waits until `health_url`
answers 200, and from then on restarts the child whenever it exits, with exponential
backoff (`SuperviseConfig`). A restarted worker is a new process, hence a new epoch: the
proxy forgets every anchor of the old one (`on_ready` tells it at once; the epoch in every
worker reply would tell it anyway). Meanwhile `status()` says `restarting`, which the
proxy's `/health` reports as `degraded`.

A child that is alive but stuck is killed (SIGKILL to its group: a stopped or wedged
process handles nothing gentler) and then restarted like one that died:
- `unresponsive`: `health_url` answered no check with 200 for `health_timeout_s`;
- `stalled`: `stalled_s()` (given by the proxy: seconds since the worker last sent output
  for the generate requests the proxy holds) passed `stall_timeout_s`, and the worker's own
  health reply still lists requests (so a counter the proxy leaked never restarts an idle
  worker). A worker whose HTTP side still answers while its engine is wedged is caught here.
Killing the process ends every connection the proxy holds to it, so the requests it held
end with the proxy's clean `worker_error` instead of waiting.

The child never outlives `serve`, even when `serve` is SIGKILLed and cleans up nothing: it
is started through this module's launcher (`python -m anchorcache.supervise PARENT_PID --
cmd...`), which on Linux sets PR_SET_PDEATHSIG=SIGKILL (kept across exec) and then execs
`cmd`; elsewhere the launcher stays as a small parent that polls for the supervisor and
kills the child when it is gone. The child runs in its own session, so a clean stop
signals its whole process group (SIGTERM, then SIGKILL after `stop_grace_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("anchorcache.supervise")

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class SuperviseConfig:
    ready_timeout_s: float = 600.0  # model loading included
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    stable_after_s: float = 60.0  # up this long: the next crash starts the backoff over
    stop_grace_s: float = 20.0
    poll_s: float = 0.2
    # a running worker that answers no health check with 200 this long is restarted (None: never)
    health_timeout_s: float | None = 30.0
    health_interval_s: float = 2.0  # between two health checks of a running worker
    # a worker that holds requests and sends nothing for this long is restarted (None: never);
    # longer than the longest prefill, which sends nothing until its first token
    stall_timeout_s: float | None = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        if self.ready_timeout_s <= 0 or self.stop_grace_s <= 0 or self.poll_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.health_interval_s <= 0:
            raise ValueError("health_interval_s must be positive")
        for name in ("health_timeout_s", "stall_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive (None turns the check off)")


@dataclass(frozen=True)
class WorkerStatus:
    state: str  # "starting" | "running" | "restarting" | "stopped"
    pid: int | None
    restarts: int
    last_exit_code: int | None  # negative: killed by that signal
    # why the last one went: "exited" (on its own), "unresponsive" or "stalled" (killed by us)
    last_restart_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == "running"

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "pid": self.pid, "restarts": self.restarts,
                "last_exit_code": self.last_exit_code,
                "last_restart_reason": self.last_restart_reason}


class WorkerExited(RuntimeError):
    """The child exited (or never answered) before it was ready."""


def launcher_cmd(cmd: Sequence[str], parent_pid: int | None = None) -> list[str]:
    """`cmd` wrapped so that the process dies with `parent_pid` (default: this process)."""
    return [sys.executable, "-m", "anchorcache.supervise",
            str(parent_pid if parent_pid is not None else os.getpid()), "--", *cmd]


class Supervisor:
    def __init__(self, cmd: Sequence[str], health_url: str,
                 config: SuperviseConfig | None = None, *,
                 on_ready: Callable[[], Awaitable[None]] | None = None,
                 stalled_s: Callable[[], float | None] | None = None) -> None:
        self.cmd = list(cmd)
        self.health_url = health_url
        self.config = config or SuperviseConfig()
        self.on_ready = on_ready  # awaited after every restart that became healthy
        # seconds the worker has sent nothing for the requests it holds (None: holds none)
        self.stalled_s = stalled_s
        self._proc: asyncio.subprocess.Process | None = None
        self._state = "stopped"
        self._restarts = 0
        self._last_exit: int | None = None
        self._last_reason: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def status(self) -> WorkerStatus:
        pid = self._proc.pid if self._proc is not None and self._proc.returncode is None else None
        return WorkerStatus(self._state, pid, self._restarts, self._last_exit, self._last_reason)

    async def start(self) -> None:
        """Start the child and wait until it is healthy; raises WorkerExited if it is not.
        Then keep it running in the background until `stop()`."""
        self._state = "starting"
        await self._spawn_ready()
        self._state = "running"
        self._task = asyncio.create_task(self._watch(), name="anchorcache-supervisor")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._terminate()
        self._state = "stopped"

    # ---- internals ------------------------------------------------------------------------
    async def _spawn_ready(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(*launcher_cmd(self.cmd),
                                                          start_new_session=True)
        log.info("worker started (pid %d): %s", self._proc.pid, " ".join(self.cmd))
        try:
            await self._wait_ready(self._proc)
        except BaseException:
            await self._terminate()
            raise

    async def _wait_ready(self, proc: asyncio.subprocess.Process) -> None:
        import aiohttp  # not at module level: the launcher below must start fast

        deadline = time.monotonic() + self.config.ready_timeout_s
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < deadline:
                if proc.returncode is not None:
                    self._last_exit = proc.returncode
                    raise WorkerExited(f"worker exited with {proc.returncode} before it was ready")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(self.health_url) as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(self.config.poll_s)
        raise WorkerExited(f"worker not ready after {self.config.ready_timeout_s:.0f} s")

    async def _watch(self) -> None:
        backoff = self.config.backoff_initial_s
        while not self._stopping:
            assert self._proc is not None
            up_since = time.monotonic()
            reason = await self._until_gone(self._proc)
            code = self._proc.returncode
            self._last_exit, self._last_reason = code, reason
            self._state = "restarting"
            if time.monotonic() - up_since >= self.config.stable_after_s:
                backoff = self.config.backoff_initial_s
            log.error("worker (pid %d) %s with %d; restarting in %.1f s", self._proc.pid,
                      "exited" if reason == "exited" else f"was {reason}: killed, exited",
                      code, backoff)
            while not self._stopping:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.backoff_max_s)
                try:
                    await self._spawn_ready()
                except (WorkerExited, OSError) as e:
                    log.error("worker restart failed: %s; next try in %.1f s", e, backoff)
                    continue
                self._restarts += 1
                self._state = "running"
                log.info("worker restarted (restart %d, pid %d)", self._restarts, self._proc.pid)
                if self.on_ready is not None:
                    try:
                        await self.on_ready()
                    except Exception:
                        log.exception("on_ready after a worker restart failed")
                break

    async def _until_gone(self, proc: asyncio.subprocess.Process) -> str:
        """Wait until the running child exits ("exited"), or kill it once it is hung and say
        how ("unresponsive", "stalled"; see the module docstring)."""
        import aiohttp

        cfg = self.config
        exited = asyncio.ensure_future(proc.wait())
        check: asyncio.Future[bool | None] | None = None
        last_ok = time.monotonic()
        try:
            async with aiohttp.ClientSession() as session:
                while True:
                    # a check may take until the health deadline: slow is not hung
                    wait_s = (last_ok + cfg.health_timeout_s - time.monotonic()
                              if cfg.health_timeout_s is not None else 10.0)
                    check = asyncio.ensure_future(self._check(session, max(wait_s, 1.0)))
                    await asyncio.wait({exited, check}, return_when=asyncio.FIRST_COMPLETED)
                    if exited.done():
                        return "exited"
                    holds_requests = check.result()
                    now = time.monotonic()
                    if holds_requests is not None:
                        last_ok = now
                    reason = None
                    if cfg.health_timeout_s is not None and now - last_ok >= cfg.health_timeout_s:
                        reason = "unresponsive"
                        log.error("worker (pid %d) answered no health check for %.0f s",
                                  proc.pid, now - last_ok)
                    elif cfg.stall_timeout_s is not None and holds_requests and \
                            self.stalled_s is not None:
                        stalled = self.stalled_s()
                        if stalled is not None and stalled >= cfg.stall_timeout_s:
                            reason = "stalled"
                            log.error("worker (pid %d) holds requests and sent nothing for "
                                      "%.0f s", proc.pid, stalled)
                    if reason is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(proc.pid, signal.SIGKILL)
                        await exited
                        return reason
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(asyncio.shield(exited), cfg.health_interval_s)
        finally:
            exited.cancel()
            if check is not None:
                check.cancel()

    async def _check(self, session: Any, timeout_s: float) -> bool | None:
        """One health check: None if it got no 200 in `timeout_s`; otherwise whether the
        worker says it holds requests (the worker contract's running/queued lists; True
        when its reply does not say)."""
        import aiohttp

        try:
            async with session.get(self.health_url,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    return None
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
        if not isinstance(body, dict) or not {"running_requests", "queued_requests"} <= body.keys():
            return True
        return bool(body["running_requests"] or body["queued_requests"])

    async def _terminate(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.config.stop_grace_s)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        # the session may hold more than the child (a backend's own helpers)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


# ---- the launcher: runs in the child, before the worker's own code ---------------------------

def _set_pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _babysit(parent_pid: int, cmd: list[str]) -> int:
    """Without PDEATHSIG: run `cmd` as a child and kill it when `parent_pid` is gone."""
    child = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    while child.poll() is None:
        if os.getppid() != parent_pid:
            child.kill()
            child.wait()
            return 1
        time.sleep(0.5)
    return child.returncode


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m anchorcache.supervise PARENT_PID -- CMD...", file=sys.stderr)
        return 2
    parent_pid, cmd = int(argv[0]), argv[2:]
    if _set_pdeathsig():
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            return 1
        os.execvp(cmd[0], cmd)
    return _babysit(parent_pid, cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
