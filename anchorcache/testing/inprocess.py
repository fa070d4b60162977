"""A proxy app served by a thread of the test process, for the tests whose subject is the
proxy's own logic rather than a process boundary: no interpreter to start, and sync clients
(httpx, the openai and anthropic SDKs) reach it by URL like a `proxy_process`."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from anchorcache.testing.servers import ADMIN_TOKEN, Endpoint

T = TypeVar("T")
START_TIMEOUT_S = 300  # the app's start-up asks the worker for its model and loads its tokenizer


@contextmanager
def proxy_in_process(worker_url: str | list[str], *, state_dir: str | None = None,
                     **config: Any) -> Iterator[Endpoint]:
    """`create_app(ProxyConfig(**config))` on a free loopback port, its event loop in a
    thread of its own; with its own ledger (a fresh temporary one unless `state_dir` is given)
    and the admin API on (token `ADMIN_TOKEN`), like `proxy_process`. Handlers are cancelled
    when their client disconnects, as under `anchorcache proxy`."""
    from aiohttp import web

    from anchorcache.proxy.app import create_app
    from anchorcache.proxy.config import ProxyConfig

    urls = (worker_url,) if isinstance(worker_url, str) else tuple(worker_url)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="proxy-in-process", daemon=True)
    thread.start()

    def call(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=START_TIMEOUT_S)

    with contextlib.ExitStack() as stack:
        if state_dir is None:
            state_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="anchorcache-state-"))
        app = create_app(ProxyConfig(worker_urls=urls, state_dir=state_dir,
                                     **{"admin_token": ADMIN_TOKEN, **config}))
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        try:
            call(runner.setup())
            call(web.TCPSite(runner, "127.0.0.1", 0).start())
            host, port = runner.addresses[0][:2]
            yield Endpoint(f"http://{host}:{port}")
        finally:
            call(runner.cleanup())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)
            loop.close()
