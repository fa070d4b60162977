"""Several proxy processes on one port: `anchorcache proxy --processes N` (`serve` likewise).

The parent serves nothing. It holds the ledger's lock (a second proxy on the same state dir
still refuses to start; the ledger's migrations run here, once), makes a fresh directory for
the processes' prometheus-client metrics files, starts N children and watches them: a child
that dies is restarted, SIGTERM and SIGINT stop them all, and a child that dies before it
ever served (a worker that does not answer, a port in use) ends the proxy with its exit
status. Each child is the one-process proxy (`create_app`), its listening socket opened with
SO_REUSEPORT, so the kernel spreads connections over them (Linux). The first child starts
alone and the others once it serves: it cleans up after an earlier proxy (unpins the leases
that one left pinned), which must not happen once a sibling may hold leases of its own.

What the children share, and how (docs/configuration.md, "Several processes"): the ledger
(SQLite in WAL mode, every write a short transaction, `busy_timeout` so writers wait for
each other); each child's anchor index follows the others' commits through the ledger's
change numbers (`AnchorSync` in app.py); tenants, keys, toolsets and pins are read from the
ledger; the tenants' in-flight quota is counted there (proxy/tenants.py); warming a toolset
takes a ledger lock (proxy/lifecycle.py); `/metrics` sums every child's files.

With N = 1 none of this runs: the CLI serves `create_app` in its own process, as always.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:  # `run_site` serves the worker too, which needs nothing of the proxy's
    from .config import ProxyConfig

log = logging.getLogger("anchorcache.proxy")

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client reads it when imported
STOP_TIMEOUT_S = 30.0  # how long stopping waits for a child (it unpins its leases) before a kill
RESTART_DELAY_S = 1.0  # between a child's death and its restart
WATCH_S = 0.2  # how often the parent looks at its children


MAX_DEFAULT_PROCESSES = 8  # each process holds its own tokenizer, memos and split thread


def default_processes() -> int:
    """`anchorcache proxy`'s default: one process per core of the box, at most
    `MAX_DEFAULT_PROCESSES` (more only when asked for)."""
    return max(1, min(MAX_DEFAULT_PROCESSES, os.cpu_count() or 1))


# The cyclic garbage collector's first threshold (CPython's default: 700). A turn of a long
# conversation allocates tens of thousands of containers (its parsed body, the messages'
# normalized copies) that die by reference counting when the turn ends; at 700, collections
# run while they are alive, promote them, and the full collections that follow walk the
# memos' long-lived messages every few turns: a quarter of a 100k-token turn's CPU, and
# most of its p99 (docs/benchmarks.md, proxy-side costs).
GC_THRESHOLD = (50_000, 20, 20)


def steady_gc() -> None:
    """Garbage collection for a serving process, once it has started: what start-up built
    (tokenizer, adapter, configuration) moved out of the collector's sight (`gc.freeze`),
    and collections rarer (`GC_THRESHOLD`)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


async def run_site(web_app: web.Application, host: str, port: int, *, reuse_port: bool = False,
                   on_started: Callable[[], None] | None = None,
                   stop: asyncio.Event | None = None) -> None:
    """Serve `web_app` on `host:port` until SIGINT or SIGTERM (or `stop` is set)."""
    runner = web.AppRunner(web_app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    await site.start()
    steady_gc()
    if on_started is not None:
        on_started()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _child_main(config: ProxyConfig, log_level: str, ready: Connection, parent: int) -> None:
    """A child's whole life (a spawned interpreter: prometheus-client is imported here, after
    the parent set `PROMETHEUS_MULTIPROC_DIR`)."""
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(name)s[{config.process_index}] %(levelname)s "
                               "%(message)s")
    from .app import create_app

    async def main() -> None:
        stop = asyncio.Event()

        async def orphaned() -> None:  # the parent was killed: do not serve on alone
            while True:
                await asyncio.sleep(1.0)
                if os.getppid() != parent:
                    stop.set()
                    return

        watch = asyncio.get_running_loop().create_task(orphaned())
        try:
            await run_site(create_app(config), config.host, config.port, reuse_port=True,
                           on_started=lambda: ready.send(os.getpid()), stop=stop)
        finally:
            watch.cancel()

    asyncio.run(main())


@dataclass
class _Child:
    index: int
    proc: BaseProcess
    ready: Connection
    served: bool = False  # it said it was listening
    restarts: int = 0


class ProxyProcesses:
    """The parent of `config.processes` proxy processes (see the module's docstring)."""

    def __init__(self, config: ProxyConfig, *, log_level: str = "info") -> None:
        assert config.processes > 1
        self.config = config
        self.log_level = log_level
        self._ctx = multiprocessing.get_context("spawn")
        self._children: list[_Child] = []
        self._metrics_dir: str | None = None

    def _start(self, index: int, restarts: int) -> _Child:
        assert self._metrics_dir is not None
        config = replace(self.config, process_index=index, process_restarts=restarts,
                         metrics_dir=self._metrics_dir)
        theirs, ours = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=_child_main, name=f"anchorcache-proxy-{index}",
                                 args=(config, self.log_level, ours, os.getpid()))
        proc.start()
        ours.close()
        return _Child(index, proc, theirs, restarts=restarts)

    async def _until_served(self, children: list[_Child]) -> int | None:
        """Wait until each of `children` serves; the exit status of one that died first."""
        while True:
            for child in children:
                if not child.served and child.ready.poll():
                    with contextlib.suppress(EOFError):
                        child.ready.recv()
                        child.served = True
                if not child.served and child.proc.exitcode is not None:
                    return child.proc.exitcode or 1
            if all(c.served for c in children):
                return None
            await asyncio.sleep(WATCH_S / 4)

    async def run(self, on_ready: Callable[[], Awaitable[None] | None] | None = None) -> int:
        """Start the children, call `on_ready` once they all serve, restart any that dies,
        until SIGINT/SIGTERM; the exit status (a child's that died before it served)."""
        from anchorcache.state.ledger import Ledger

        ledger = Ledger.open(self.config.state_dir, exclusive=True)  # LedgerError: in use
        self._metrics_dir = tempfile.mkdtemp(prefix="anchorcache-metrics-")
        os.environ[METRICS_DIR_ENV] = self._metrics_dir
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            first = self._start(0, 0)
            self._children = [first]
            failed = await self._race(self._until_served([first]), stop)
            if failed is None and not stop.is_set():
                rest = [self._start(i, 0) for i in range(1, self.config.processes)]
                self._children += rest
                failed = await self._race(self._until_served(rest), stop)
            if failed is not None:
                log.error("a proxy process exited with status %d before it served", failed)
                return failed
            if stop.is_set():
                return 0
            log.info("%d proxy processes serve on %s:%d", len(self._children), self.config.host,
                     self.config.port)
            if on_ready is not None:
                done = on_ready()
                if done is not None:
                    await done
            await self._watch(stop)
            return 0
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await self._stop_all()
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
            os.environ.pop(METRICS_DIR_ENV, None)
            ledger.close()

    @staticmethod
    async def _race(wait: Awaitable[int | None], stop: asyncio.Event) -> int | None:
        """`wait`'s result, or None as soon as `stop` is set."""
        task = asyncio.ensure_future(wait)
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not task.done():
            task.cancel()
            return None
        return task.result()

    async def _watch(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for i, child in enumerate(self._children):
                if child.proc.exitcode is None:
                    continue
                self._dead(child)
                log.warning("proxy process %d (pid %s) exited with %s; restarting it",
                            child.index, child.proc.pid, child.proc.exitcode)
                await asyncio.sleep(RESTART_DELAY_S)
                if stop.is_set():
                    return
                self._children[i] = self._start(child.index, child.restarts + 1)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), WATCH_S)

    def _dead(self, child: _Child) -> None:
        from prometheus_client import multiprocess  # its live gauges' files (none today)

        if child.proc.pid is not None and self._metrics_dir is not None:
            multiprocess.mark_process_dead(child.proc.pid, self._metrics_dir)
        child.ready.close()

    async def _stop_all(self) -> None:
        """SIGTERM every child, wait for them (each unpins its leases), kill the late ones."""
        for child in self._children:
            if child.proc.exitcode is None:
                child.proc.terminate()
        deadline = asyncio.get_running_loop().time() + STOP_TIMEOUT_S
        for child in self._children:
            left = deadline - asyncio.get_running_loop().time()
            await asyncio.to_thread(child.proc.join, max(0.0, left))
            if child.proc.exitcode is None:
                log.warning("proxy process %d did not stop in time: killed", child.index)
                child.proc.kill()
                child.proc.join(5)
            child.proc.join(0)
