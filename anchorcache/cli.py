"""The `anchorcache` command: serve, worker, proxy, split.

Every option can also come from an `ANCHORCACHE_*` environment variable (named next to it
in `--help` and in the README); this file is the one place that reads them. A bad value
fails at start with a message, never silently defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="anchorcache: prefix-cache sidecar for LLM agent traffic.")

Host = Annotated[str, typer.Option(envvar="ANCHORCACHE_HOST", help="Address to listen on.")]
Model = Annotated[str | None, typer.Option(envvar="ANCHORCACHE_MODEL",
                                           help="Local HF model dir (default: SmolLM2-135M-Instruct).")]
Anchors = Annotated[bool, typer.Option("--anchors/--no-anchors", envvar="ANCHORCACHE_ANCHORS",
                                       help="Anchored prefix caching (off: plain prefill).")]
Threads = Annotated[int | None, typer.Option(envvar="ANCHORCACHE_THREADS", min=1,
                                             help="Torch CPU threads in the worker.")]
Adapter = Annotated[str, typer.Option(envvar="ANCHORCACHE_ADAPTER",
                                      help="Chat-template adapter ('auto' picks).")]
LogLevel = Annotated[str, typer.Option(envvar="ANCHORCACHE_LOG_LEVEL")]
AnchorSlots = Annotated[int, typer.Option(envvar="ANCHORCACHE_ANCHOR_SLOTS", min=2,
                                          help="Anchor slots in the worker.")]
AnchorBytes = Annotated[int, typer.Option(envvar="ANCHORCACHE_ANCHOR_BYTES", min=1 << 20,
                                          help="Anchor memory budget in the worker (bytes).")]
MaxBody = Annotated[int, typer.Option(envvar="ANCHORCACHE_MAX_BODY_BYTES", min=1024,
                                      help="Largest request body the proxy accepts.")]
TenantSalt = Annotated[str, typer.Option(envvar="ANCHORCACHE_TENANT_SALT", show_default=False,
                                         help="Server-side secret mixed into every anchor key.")]
FaultInjection = Annotated[bool, typer.Option(envvar="ANCHORCACHE_FAULT_INJECTION", hidden=True,
                                              help="Enable /debug/fault on the worker (tests).")]


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")


async def _serve_forever(web_app, host: str, port: int, banner: str) -> None:
    from aiohttp import web

    runner = web.AppRunner(web_app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(banner.format(host=host, port=port), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


Backend = Annotated[str, typer.Option(envvar="ANCHORCACHE_BACKEND",
                                      help="Worker backend: embedded or sglang.")]
SGLangLogLevel = Annotated[str, typer.Option(envvar="ANCHORCACHE_SGLANG_LOG_LEVEL",
                                             help="SGLang's own log level (sglang backend).")]
_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def _sglang_worker(host: str, port: int, model: str | None, anchor_slots: int, anchor_bytes: int,
                   sglang_log_level: str, extra: list[str]) -> None:
    """Replace this process with SGLang + our plugin (docs/sglang.md)."""
    from anchorcache.ext.embedded.model_store import resolve_model
    from anchorcache.ext.sglang import cpu
    from anchorcache.ext.sglang.config import SGLangAnchorConfig

    config = SGLangAnchorConfig(anchor_slots=anchor_slots, anchor_capacity_bytes=anchor_bytes,
                                pinned_slots=min(16, anchor_slots // 4))
    gpu = cpu.has_gpu()
    env = {**os.environ, **config.to_env()}
    if not gpu:
        env = cpu.cpu_env(env)
    cmd = cpu.sglang_command(sys.executable, model=str(resolve_model(model)), host=host, port=port,
                             log_level=sglang_log_level, extra=extra, gpu=gpu)
    sys.stdout.flush()
    os.execve(sys.executable, cmd, env)


@app.command(context_settings=_PASSTHROUGH)
def worker(
    ctx: typer.Context,
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="ANCHORCACHE_WORKER_PORT")] = 8001,
    backend: Backend = "embedded",
    model: Model = None,
    threads: Threads = None,
    dtype: Annotated[str, typer.Option(envvar="ANCHORCACHE_DTYPE")] = "float32",
    anchor_slots: AnchorSlots = 256,
    anchor_bytes: AnchorBytes = 4 << 30,
    fault_injection: FaultInjection = False,
    log_level: LogLevel = "info",
    sglang_log_level: SGLangLogLevel = "warning",
) -> None:
    """Run a worker behind the worker contract: the embedded transformers engine, or SGLang
    with the anchorcache plugin (`--backend sglang [-- SGLANG_ARGS...]`)."""
    if backend == "sglang":
        _sglang_worker(host, port, model, anchor_slots, anchor_bytes, sglang_log_level,
                       list(ctx.args))
        return
    if backend != "embedded":
        raise typer.BadParameter(f"unknown backend {backend!r} (available: embedded, sglang)")
    if ctx.args:
        raise typer.BadParameter(f"unexpected arguments {ctx.args} (only --backend sglang "
                                 "passes arguments through)")
    _logging(log_level)
    from anchorcache.ext.embedded.app import WorkerConfig, create_app

    config = WorkerConfig(model=model, threads=threads, dtype=dtype, anchor_slots=anchor_slots,
                          anchor_capacity_bytes=anchor_bytes,
                          pinned_slots=min(16, anchor_slots // 4), fault_injection=fault_injection)
    asyncio.run(_serve_forever(create_app(config), host, port,
                               "anchorcache worker listening on http://{host}:{port}"))


@app.command()
def proxy(
    worker: Annotated[str, typer.Option(envvar="ANCHORCACHE_WORKER_URL", help="Worker base URL.")]
    = "http://127.0.0.1:8001",
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="ANCHORCACHE_PORT")] = 8000,
    anchors: Anchors = True,
    adapter: Adapter = "auto",
    max_body_bytes: MaxBody = 32 << 20,
    tenant_salt: TenantSalt = "anchorcache-default-tenant",
    log_level: LogLevel = "info",
) -> None:
    """Run the OpenAI-compatible proxy in front of a running worker."""
    _logging(log_level)
    from anchorcache.proxy.app import create_app
    from anchorcache.proxy.config import ProxyConfig

    config = ProxyConfig(worker_url=worker, host=host, port=port, anchors=anchors, adapter=adapter,
                         max_body_bytes=max_body_bytes, tenant_salt=tenant_salt)
    asyncio.run(_serve_forever(create_app(config), host, port,
                               "anchorcache proxy listening on http://{host}:{port}/v1"))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


@app.command(context_settings=_PASSTHROUGH)
def serve(
    ctx: typer.Context,
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="ANCHORCACHE_PORT")] = 8000,
    backend: Backend = "embedded",
    model: Model = None,
    anchors: Anchors = True,
    adapter: Adapter = "auto",
    threads: Threads = None,
    anchor_slots: AnchorSlots = 256,
    anchor_bytes: AnchorBytes = 4 << 30,
    max_body_bytes: MaxBody = 32 << 20,
    tenant_salt: TenantSalt = "anchorcache-default-tenant",
    log_level: LogLevel = "info",
    sglang_log_level: SGLangLogLevel = "warning",
) -> None:
    """Start a worker (embedded, or SGLang with `--backend sglang [-- SGLANG_ARGS...]`) and
    the proxy; Ctrl-C/SIGTERM stops both."""
    if backend not in ("embedded", "sglang"):
        raise typer.BadParameter(f"unknown backend {backend!r} (available: embedded, sglang)")
    _logging(log_level)
    if model is None:  # convert the default model once, in the foreground, with a message
        from anchorcache.ext.embedded.model_store import default_model_dir, prepare_default_model
        if not (default_model_dir() / "config.json").exists():
            print("preparing the default model (one-time conversion, ~20 s)...", flush=True)
        model = str(prepare_default_model())
    worker_port = free_port()
    cmd = [sys.executable, "-m", "anchorcache.cli", "worker", "--host", "127.0.0.1",
           "--port", str(worker_port), "--model", model, "--anchor-slots", str(anchor_slots),
           "--anchor-bytes", str(anchor_bytes), "--log-level", log_level, "--backend", backend]
    if threads and backend == "embedded":
        cmd += ["--threads", str(threads)]
    if backend == "sglang":
        cmd += ["--sglang-log-level", sglang_log_level, "--", *ctx.args]
    elif ctx.args:
        raise typer.BadParameter(f"unexpected arguments {ctx.args}")
    proc = subprocess.Popen(cmd, start_new_session=True)

    def stop_worker(*_: object) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()

    try:
        wait_ready(f"http://127.0.0.1:{worker_port}/health", proc, timeout_s=600)
        proxy(worker=f"http://127.0.0.1:{worker_port}", host=host, port=port, anchors=anchors,
              adapter=adapter, max_body_bytes=max_body_bytes, tenant_salt=tenant_salt,
              log_level=log_level)
    finally:
        stop_worker()


@app.command()
def split(
    request: Annotated[str, typer.Argument(help="Request JSON file, or - for stdin.")],
    model: Annotated[str | None, typer.Option(help="Tokenizer: model dir, or qwen3/llama3/"
                                                    "mistral/gpt-oss (default: the default model).")] = None,
    adapter: Adapter = "auto",
) -> None:
    """Print the adapter, input_ids and every verified cut of a chat request, as JSON."""
    import orjson

    from anchorcache.proxy.splitter.cli import run_split

    try:
        result = run_split(model, adapter, request)
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()


if __name__ == "__main__":
    main()
