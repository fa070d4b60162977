"""The `anchorcache` command: serve, worker, proxy, split, bench.

Every option can also come from an `ANCHORCACHE_*` environment variable (named next to it
in `--help` and in docs/configuration.md); this file is the one place that reads them. A bad value
fails at start with a message, never silently defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import typer

from anchorcache.defaults import (
    ANCHOR_BYTES,
    ANCHOR_SLOTS,
    LEASE_BUDGET_BYTES,
    PIN_BUDGET_BYTES,
    TOOL_ANCHOR_GAP_TOKENS,
)
from anchorcache.paths import default_state_dir
from anchorcache.supervise import SuperviseConfig, Supervisor, WorkerExited
from anchorcache.wire import WORKER_SECRET_ENV, check_secret

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
CanonicalTools = Annotated[bool, typer.Option(
    "--canonical-tools/--client-tools", envvar="ANCHORCACHE_CANONICAL_TOOLS",
    help="Sort tools and schema keys before rendering: more anchor sharing between clients, "
         "but the prompt differs from the model's own template (default: client order).")]
ToolAnchorGap = Annotated[int, typer.Option(
    envvar="ANCHORCACHE_TOOL_ANCHOR_GAP", min=0,
    help="Tool anchors inside the instruction prefix, at least this many tokens apart, so "
         "toolsets that start with the same tools share that prefix (0: none).")]
LogLevel = Annotated[str, typer.Option(envvar="ANCHORCACHE_LOG_LEVEL")]
AnchorSlots = Annotated[int, typer.Option(envvar="ANCHORCACHE_ANCHOR_SLOTS", min=2,
                                          help="Anchor slots in the worker.")]
AnchorBytes = Annotated[int, typer.Option(envvar="ANCHORCACHE_ANCHOR_BYTES", min=1 << 20,
                                          help="Anchor memory budget in the worker (bytes).")]
AnchorDiskDir = Annotated[str | None, typer.Option(
    envvar="ANCHORCACHE_ANCHOR_DISK_DIR",
    help="Directory of the worker's disk tier of anchors (docs/disk-tier.md); `serve` "
         "defaults it to STATE_DIR/anchor-disk, a lone worker has none unless given.")]
AnchorDiskBytes = Annotated[int | None, typer.Option(
    envvar="ANCHORCACHE_ANCHOR_DISK_BYTES", min=0,
    help="Disk tier budget (bytes); default a tenth of the free disk; 0 turns it off.")]
MaxBody = Annotated[int, typer.Option(envvar="ANCHORCACHE_MAX_BODY_BYTES", min=1024,
                                      help="Largest request body the proxy accepts.")]
MaxTokensPolicy = Annotated[str, typer.Option(
    envvar="ANCHORCACHE_MAX_TOKENS_POLICY",
    help="A max_tokens beyond the room the prompt leaves in the context: clamp it to that room "
         "(the reply ends with finish_reason length / stop_reason max_tokens if it gets there) "
         "or refuse it (400).")]
ServedModelName = Annotated[list[str] | None, typer.Option(
    envvar="ANCHORCACHE_SERVED_MODEL_NAME",
    help="Another name the model answers to besides its id and 'default' (repeatable; '*' for "
         "any name), for clients that send their vendor's model names (docs/agents.md).")]
StateDir = Annotated[str, typer.Option(envvar="ANCHORCACHE_STATE_DIR",
                                       show_default="~/.local/state/anchorcache",
                                       help="Directory of the proxy's ledger (SQLite: tenants, "
                                            "keys, toolsets, anchors).")]
AdminToken = Annotated[str | None, typer.Option(envvar="ANCHORCACHE_ADMIN_TOKEN", show_default=False,
                                                help="Token of the /admin API (off if unset).")]
TenantShare = Annotated[float, typer.Option(
    envvar="ANCHORCACHE_TENANT_ANCHOR_SHARE", min=0.01, max=1.0,
    help="Share of each worker's anchor memory a tenant without a byte quota of its own may "
         "hold (1: no limit).")]
WorkerSecret = Annotated[str | None, typer.Option(
    envvar=WORKER_SECRET_ENV, show_default=False,
    help="Secret the proxy and its workers share: a worker refuses every call but /health "
         "without it (required for a worker listening beyond loopback; `serve` makes one).")]
Anonymous = Annotated[bool | None, typer.Option("--anonymous/--no-anonymous",
                                                envvar="ANCHORCACHE_ANONYMOUS", show_default=False,
                                                help="Serve requests without an API key as the "
                                                     "anonymous tenant (default: on when "
                                                     "listening on loopback).")]
StrictKeys = Annotated[bool, typer.Option("--strict-keys/--placeholder-keys",
                                          envvar="ANCHORCACHE_STRICT_KEYS",
                                          help="Refuse unknown API keys even while no tenant "
                                               "exists (default: until the first tenant, any "
                                               "key is the anonymous tenant, like no key).")]
MaxInFlight = Annotated[int, typer.Option(envvar="ANCHORCACHE_MAX_IN_FLIGHT", min=1,
                                          help="Default per-tenant requests in flight (429 past it).")]
MaxPinned = Annotated[int, typer.Option(envvar="ANCHORCACHE_MAX_PINNED_TOOLSETS", min=0,
                                        help="Default per-tenant pinned toolsets.")]
PinBudget = Annotated[int, typer.Option(envvar="ANCHORCACHE_PIN_BUDGET_BYTES", min=0,
                                        help="Anchor bytes all pinned toolsets may hold together.")]
LeaseBudget = Annotated[int, typer.Option(
    envvar="ANCHORCACHE_LEASE_BUDGET_BYTES", min=0,
    help="Anchor bytes all cache_control TTL leases on one worker may keep together (and "
         "at most half of its anchor memory).")]
MetricsMaxTenants = Annotated[int, typer.Option(envvar="ANCHORCACHE_METRICS_MAX_TENANTS", min=1,
                                                help="Distinct tenant labels in /metrics; "
                                                     "later tenants count as 'other'.")]
MetricsWorkerTimeout = Annotated[float, typer.Option(
    envvar="ANCHORCACHE_METRICS_WORKER_TIMEOUT_S", min=0.01, max=60,
    help="Seconds /metrics waits for the worker's /anchor/stats.")]
ResponseTtl = Annotated[float, typer.Option(
    envvar="ANCHORCACHE_RESPONSE_TTL_S", min=1,
    help="Seconds a stored Responses API response (store: true) can be continued with "
         "previous_response_id or read back.")]
WorkerHealthTimeout = Annotated[float, typer.Option(
    envvar="ANCHORCACHE_WORKER_HEALTH_TIMEOUT_S", min=0,
    help="Restart a worker that answers no health check for this long (0: never).")]
WorkerStallTimeout = Annotated[float, typer.Option(
    envvar="ANCHORCACHE_WORKER_STALL_TIMEOUT_S", min=0,
    help="Restart a worker that holds requests and sends nothing for this long; longer than "
         "the longest prefill (0: never).")]
FaultInjection = Annotated[bool, typer.Option(envvar="ANCHORCACHE_FAULT_INJECTION", hidden=True,
                                              help="Enable /debug/fault on the worker (tests).")]


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")


async def _serve_forever(web_app, host: str, port: int, banner: str) -> None:
    from anchorcache.proxy.processes import run_site

    await run_site(web_app, host, port,
                   on_started=lambda: print(banner.format(host=host, port=port), flush=True))


PROXY_BANNER = "anchorcache proxy listening on http://{host}:{port}/v1"
Processes = Annotated[int | None, typer.Option(
    envvar="ANCHORCACHE_PROCESSES", min=1, show_default=False,
    help="Proxy processes sharing the port (SO_REUSEPORT) and the ledger (default: one per "
         "core, at most 8, for `proxy`; 1 for `serve`, whose worker shares the box).")]


async def _serve_processes(config, log_level: str) -> int:
    """`config.processes` proxy processes (anchorcache/proxy/processes.py); the exit status."""
    from anchorcache.proxy.processes import ProxyProcesses

    def banner() -> None:
        print(PROXY_BANNER.format(host=config.host, port=config.port)
              + f" ({config.processes} processes)", flush=True)

    return await ProxyProcesses(config, log_level=log_level).run(on_ready=banner)


Backend = Annotated[str, typer.Option(envvar="ANCHORCACHE_BACKEND",
                                      help="Worker backend: embedded or sglang.")]
SGLangLogLevel = Annotated[str, typer.Option(envvar="ANCHORCACHE_SGLANG_LOG_LEVEL",
                                             help="SGLang's own log level (sglang backend).")]
_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def _require_sglang() -> None:
    """`--backend sglang` runs inside SGLang, which `make serve` does not install: say how to
    get it instead of failing on an import deep in the worker."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        typer.echo("error: --backend sglang needs SGLang 0.5.23, which is not installed here "
                   f"({sys.executable}). Install it with `make setup-sglang` (into .venv, "
                   "about 11 GB) or `pip install sglang==0.5.23`.", err=True)
        raise typer.Exit(2)


def _refuse_parallelism(sglang_args: list[str]) -> None:
    """SGLang's data/pipeline parallelism is not served (`cpu.parallelism_refusal`): a usage
    error before anything starts."""
    from anchorcache.ext.sglang import cpu

    refusal = cpu.parallelism_refusal(sglang_args)
    if refusal is not None:
        raise typer.BadParameter(refusal)


def _worker_secret(secret: str | None, host: str) -> str | None:
    """The worker's secret, checked: a usage error when short, or missing on a worker that
    listens beyond loopback (anyone on that network could flush, pin or generate)."""
    from anchorcache.proxy.config import is_loopback

    try:
        check_secret(secret, "worker secret")
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if secret is None and not is_loopback(host):
        raise typer.BadParameter(f"a worker listening on {host} needs --worker-secret (or "
                                 f"{WORKER_SECRET_ENV}), which its proxy is given too")
    return secret


def _sglang_worker(host: str, port: int, model: str | None, anchor_slots: int, anchor_bytes: int,
                   sglang_log_level: str, extra: list[str], fault_injection: bool = False,
                   secret: str | None = None, disk_dir: str | None = None,
                   disk_bytes: int | None = None) -> None:
    """Replace this process with SGLang + our plugin (docs/sglang.md). The worker secret
    goes to the launcher in the environment (never on a command line, which any local user
    can read), and becomes SGLang's own API key: every route but its health and metrics."""
    from anchorcache.ext.embedded.model_store import resolve_model
    from anchorcache.ext.sglang import cpu
    from anchorcache.ext.sglang.config import SGLangAnchorConfig

    _refuse_parallelism(extra)
    config = SGLangAnchorConfig(anchor_slots=anchor_slots, anchor_capacity_bytes=anchor_bytes,
                                pinned_slots=anchor_slots // 4,
                                fault_injection=fault_injection, anchor_disk_dir=disk_dir,
                                anchor_disk_bytes=disk_bytes)
    gpu = cpu.has_gpu()
    env = {**os.environ, **config.to_env()}
    env.pop(WORKER_SECRET_ENV, None)
    if secret is not None:
        env[WORKER_SECRET_ENV] = secret
    if not gpu:
        env = cpu.cpu_env(env, extra)  # with --tp N: each rank's cores
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
    anchor_slots: AnchorSlots = ANCHOR_SLOTS,
    anchor_bytes: AnchorBytes = ANCHOR_BYTES,
    anchor_disk_dir: AnchorDiskDir = None,
    anchor_disk_bytes: AnchorDiskBytes = None,
    fault_injection: FaultInjection = False,
    worker_secret: WorkerSecret = None,
    log_level: LogLevel = "info",
    sglang_log_level: SGLangLogLevel = "warning",
) -> None:
    """Run a worker behind the worker contract: the embedded transformers engine, or SGLang
    with the anchorcache plugin (`--backend sglang [-- SGLANG_ARGS...]`)."""
    worker_secret = _worker_secret(worker_secret, host)
    if backend == "sglang":
        _require_sglang()
        _sglang_worker(host, port, model, anchor_slots, anchor_bytes, sglang_log_level,
                       list(ctx.args), fault_injection, worker_secret, anchor_disk_dir,
                       anchor_disk_bytes)
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
                          pinned_slots=anchor_slots // 4, fault_injection=fault_injection,
                          secret=worker_secret, anchor_disk_dir=anchor_disk_dir,
                          anchor_disk_bytes=anchor_disk_bytes)
    try:
        asyncio.run(_serve_forever(create_app(config), host, port,
                                   "anchorcache worker listening on http://{host}:{port}"))
    except NotImplementedError as e:  # at load: a cache the embedded worker cannot snapshot
        typer.echo(f"error: the embedded worker cannot serve {model}: {e}. `--backend sglang` "
                   "serves sliding-window models (docs/sglang.md).", err=True)
        raise typer.Exit(2) from None


@app.command()
def proxy(
    worker: Annotated[list[str] | None, typer.Option(
        help="Worker base URL; give it once per worker (or ANCHORCACHE_WORKER_URLS, "
             "comma-separated).")] = None,
    route: Annotated[str, typer.Option(
        envvar="ANCHORCACHE_ROUTE",
        help="How requests pick a worker: affinity (deepest anchor chain, unless its load is "
             "--route-max-imbalance above the least loaded), least_load, round_robin.")]
    = "affinity",
    route_max_imbalance: Annotated[int, typer.Option(
        envvar="ANCHORCACHE_ROUTE_MAX_IMBALANCE",
        help="Affinity yields to a worker with this many fewer requests in flight.")] = 2,
    health_interval_s: Annotated[float, typer.Option(
        envvar="ANCHORCACHE_HEALTH_INTERVAL_S",
        help="Seconds between health checks of every worker (failover, coming back).")] = 2.0,
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="ANCHORCACHE_PORT")] = 8000,
    anchors: Anchors = True,
    adapter: Adapter = "auto",
    canonical_tools: CanonicalTools = False,
    tool_anchor_gap: ToolAnchorGap = TOOL_ANCHOR_GAP_TOKENS,
    max_body_bytes: MaxBody = 32 << 20,
    max_tokens_policy: MaxTokensPolicy = "clamp",
    served_model_name: ServedModelName = None,
    state_dir: StateDir = str(default_state_dir()),
    admin_token: AdminToken = None,
    anonymous: Anonymous = None,
    strict_keys: StrictKeys = False,
    max_in_flight: MaxInFlight = 64,
    max_pinned_toolsets: MaxPinned = 8,
    pin_budget_bytes: PinBudget = PIN_BUDGET_BYTES,
    lease_budget_bytes: LeaseBudget = LEASE_BUDGET_BYTES,
    metrics_max_tenants: MetricsMaxTenants = 100,
    metrics_worker_timeout_s: MetricsWorkerTimeout = 1.0,
    worker_secret: WorkerSecret = None,
    tenant_anchor_share: TenantShare = 0.5,
    response_ttl_s: ResponseTtl = 24 * 3600.0,
    processes: Processes = None,
    log_level: LogLevel = "info",
) -> None:
    """Run the OpenAI-compatible proxy in front of running workers (one or more)."""
    _logging(log_level)
    from anchorcache.proxy.app import create_app
    from anchorcache.proxy.config import ProxyConfig
    from anchorcache.proxy.processes import default_processes
    from anchorcache.state.records import Quotas

    urls = [u.strip() for w in (worker or []) for u in w.split(",") if u.strip()]
    if not urls:
        env = os.environ.get("ANCHORCACHE_WORKER_URLS") or os.environ.get("ANCHORCACHE_WORKER_URL")
        urls = [u.strip() for u in (env or "http://127.0.0.1:8001").split(",") if u.strip()]
    try:
        config = ProxyConfig(worker_urls=tuple(urls), route=route,
                             route_max_imbalance=route_max_imbalance,
                             health_interval_s=health_interval_s, host=host, port=port,
                             anchors=anchors, adapter=adapter, canonical_tools=canonical_tools,
                             tool_anchor_gap=tool_anchor_gap,
                             max_body_bytes=max_body_bytes, state_dir=state_dir,
                             max_tokens_policy=max_tokens_policy,
                             served_model_names=tuple(served_model_name or ()),
                             admin_token=admin_token or None, anonymous=anonymous,
                             strict_keys=strict_keys,
                             default_quotas=Quotas(max_pinned_toolsets=max_pinned_toolsets,
                                                   max_in_flight=max_in_flight),
                             pin_budget_bytes=pin_budget_bytes,
                             lease_budget_bytes=lease_budget_bytes,
                             metrics_max_tenants=metrics_max_tenants,
                             metrics_worker_timeout_s=metrics_worker_timeout_s,
                             worker_secret=worker_secret,
                             tenant_anchor_share=tenant_anchor_share,
                             response_ttl_s=response_ttl_s,
                             processes=processes or default_processes())
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    from anchorcache.state.ledger import LedgerError

    try:
        if config.processes == 1:
            asyncio.run(_serve_forever(create_app(config), host, port, PROXY_BANNER))
        elif code := asyncio.run(_serve_processes(config, log_level)):
            raise typer.Exit(code)
    except LedgerError as e:  # another proxy holds this ledger
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None



def _ephemeral_floor() -> int:
    """The lowest port of the kernel's ephemeral range (outgoing connections and bind(0))."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


PORT_SHARD_ENV = "ANCHORCACHE_PORT_SHARD"  # "k/n": pick from the k-th of n slices (tests)


_handed_ports: set[int] = set()  # what free_port returned in this process


def free_port(host: str = "127.0.0.1", avoid: Iterable[int] = ()) -> int:
    """A port free now, for a server we start. Chosen below the ephemeral range: an SGLang
    worker binds its port only after loading its model, up to a minute later, and a port from
    that range can meanwhile be taken by any outgoing connection on the machine. Under
    `ANCHORCACHE_PORT_SHARD=k/n` (the test suite's k-th of n parallel processes), only from the
    k-th of n slices of that range, so that processes running side by side never pick the
    same port for servers that bind late. A port is never handed out twice by one process,
    nor one in `avoid` (a port chosen elsewhere, say by our parent, and not bound yet): two
    servers that bind late would otherwise race for it."""
    floor = _ephemeral_floor()
    lo, hi = floor // 2, floor
    shard = os.environ.get(PORT_SHARD_ENV, "")
    if shard:
        k, n = (int(x) for x in shard.split("/"))
        width = (hi - lo) // n
        lo, hi = lo + k * width, lo + (k + 1) * width
    taken = _handed_ports | set(avoid)
    rng = random.SystemRandom()
    for _ in range(64 if floor > 4096 else 0):
        port = rng.randrange(lo, hi)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_ports.add(port)
        return port
    while True:  # the kernel's choice, from the ephemeral range
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in taken:
            _handed_ports.add(port)
            return port


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
    canonical_tools: CanonicalTools = False,
    tool_anchor_gap: ToolAnchorGap = TOOL_ANCHOR_GAP_TOKENS,
    threads: Threads = None,
    anchor_slots: AnchorSlots = ANCHOR_SLOTS,
    anchor_bytes: AnchorBytes = ANCHOR_BYTES,
    anchor_disk_dir: AnchorDiskDir = None,
    anchor_disk_bytes: AnchorDiskBytes = None,
    max_body_bytes: MaxBody = 32 << 20,
    max_tokens_policy: MaxTokensPolicy = "clamp",
    served_model_name: ServedModelName = None,
    state_dir: StateDir = str(default_state_dir()),
    admin_token: AdminToken = None,
    anonymous: Anonymous = None,
    strict_keys: StrictKeys = False,
    metrics_max_tenants: MetricsMaxTenants = 100,
    metrics_worker_timeout_s: MetricsWorkerTimeout = 1.0,
    worker_health_timeout_s: WorkerHealthTimeout = 30.0,
    worker_stall_timeout_s: WorkerStallTimeout = 300.0,
    worker_secret: WorkerSecret = None,
    tenant_anchor_share: TenantShare = 0.5,
    response_ttl_s: ResponseTtl = 24 * 3600.0,
    processes: Processes = None,
    log_level: LogLevel = "info",
    sglang_log_level: SGLangLogLevel = "warning",
) -> None:
    """Start a worker (embedded, or SGLang with `--backend sglang [-- SGLANG_ARGS...]`) and
    the proxy; the worker is restarted if it dies, and Ctrl-C/SIGTERM stops both."""
    if backend not in ("embedded", "sglang"):
        raise typer.BadParameter(f"unknown backend {backend!r} (available: embedded, sglang)")
    if backend == "sglang":
        _require_sglang()
        _refuse_parallelism(ctx.args)
    _logging(log_level)
    if model is None:  # convert the default model once, in the foreground, with a message
        from anchorcache.ext.embedded.model_store import default_model_dir, prepare_default_model
        if not (default_model_dir() / "config.json").exists():
            print("preparing the default model (one-time conversion, ~20 s)...", flush=True)
        model = str(prepare_default_model())
    worker_port = free_port(avoid=(port,))  # ours may be chosen but not bound yet
    cmd = [sys.executable, "-m", "anchorcache.cli", "worker", "--host", "127.0.0.1",
           "--port", str(worker_port), "--model", model, "--anchor-slots", str(anchor_slots),
           "--anchor-bytes", str(anchor_bytes), "--log-level", log_level, "--backend", backend]
    if threads and backend == "embedded":
        cmd += ["--threads", str(threads)]
    # the disk tier lives in the state dir unless told otherwise: a restarted worker is warm
    cmd += ["--anchor-disk-dir", anchor_disk_dir or os.path.join(state_dir, "anchor-disk")]
    if anchor_disk_bytes is not None:
        cmd += ["--anchor-disk-bytes", str(anchor_disk_bytes)]
    if backend == "sglang":
        cmd += ["--sglang-log-level", sglang_log_level, "--", *ctx.args]
    elif ctx.args:
        raise typer.BadParameter(f"unexpected arguments {ctx.args}")
    from anchorcache.proxy.config import ProxyConfig

    try:  # checked before the worker starts, as `proxy` checks it
        config = ProxyConfig(worker_urls=(f"http://127.0.0.1:{worker_port}",), host=host,
                             port=port, anchors=anchors, adapter=adapter,
                             canonical_tools=canonical_tools, tool_anchor_gap=tool_anchor_gap,
                             max_body_bytes=max_body_bytes,
                             max_tokens_policy=max_tokens_policy,
                             served_model_names=tuple(served_model_name or ()),
                             state_dir=state_dir, admin_token=admin_token or None,
                             anonymous=anonymous, strict_keys=strict_keys,
                             metrics_max_tenants=metrics_max_tenants,
                             metrics_worker_timeout_s=metrics_worker_timeout_s,
                             worker_secret=worker_secret or secrets.token_urlsafe(32),
                             tenant_anchor_share=tenant_anchor_share,
                             response_ttl_s=response_ttl_s, processes=processes or 1)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    # the worker learns the secret from its environment (a command line is public)
    os.environ[WORKER_SECRET_ENV] = config.worker_secret or ""
    watch = SuperviseConfig(health_timeout_s=worker_health_timeout_s or None,
                            stall_timeout_s=worker_stall_timeout_s or None)
    from anchorcache.state.ledger import LedgerError

    try:
        if code := asyncio.run(_serve_supervised(cmd, config, watch, log_level)):
            raise typer.Exit(code)
    except WorkerExited as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    except LedgerError as e:  # another proxy holds this ledger
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


async def _serve_supervised(worker_cmd: list[str], config, watch: SuperviseConfig,
                            log_level: str) -> int:
    """The proxy in front of a supervised worker (anchorcache/supervise.py): the worker is
    given by its command line only, whatever its backend. Several proxy processes see a
    restarted worker's new epoch at their next health check or reply, and the worker is not
    watched for stalls (the requests it holds are theirs); the exit status."""
    from anchorcache.proxy.app import create_app, refresh_worker_epoch
    from anchorcache.proxy.running import STATE

    supervisor = Supervisor(worker_cmd, config.worker_url + "/health", watch)
    await supervisor.start()
    try:
        if config.processes > 1:
            return await _serve_processes(config, log_level)
        web_app = create_app(config, worker_status=supervisor.status)

        async def on_ready() -> None:
            await refresh_worker_epoch(web_app)

        def stalled_s() -> float | None:  # the proxy's view: it holds the requests
            state = web_app.get(STATE)
            return state.targets.primary.worker.progress.stalled_s() if state is not None else None

        supervisor.on_ready = on_ready
        supervisor.stalled_s = stalled_s
        await _serve_forever(web_app, config.host, config.port, PROXY_BANNER)
        return 0
    finally:
        await supervisor.stop()


@app.command()
def split(
    request: Annotated[str, typer.Argument(help="Request JSON file, or - for stdin.")],
    model: Annotated[str | None, typer.Option(help="Tokenizer: model dir, or qwen3/llama3/"
                                                    "mistral/gpt-oss (default: the default model).")] = None,
    adapter: Adapter = "auto",
    canonical_tools: CanonicalTools = False,
) -> None:
    """Print the adapter, where it deliberately deviates from the model's chat template
    (`deviation`, null if nowhere), input_ids and every verified cut of a chat request."""
    import orjson

    from anchorcache.proxy.splitter.cli import run_split

    try:
        result = run_split(model, adapter, request, canonical_tools=canonical_tools)
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")


@app.command()
def bench(
    conversations: Annotated[Path, typer.Argument(
        help="Conversations JSON: a list of {id, messages, tools} (the shared data's format).")],
    url: Annotated[str, typer.Option(envvar="ANCHORCACHE_URL", help="Proxy base URL (anchors on).")]
    = "http://127.0.0.1:8000",
    baseline_url: Annotated[str | None, typer.Option(
        help="Anchors-off proxy to compare with (default: --url, anchors off per request).")]
    = None,
    api_key: Annotated[str | None, typer.Option(envvar="ANCHORCACHE_API_KEY", show_default=False,
                                                help="Bearer token sent to the proxies.")] = None,
    limit: Annotated[int | None, typer.Option("--conversations", min=1,
                                              help="Replay only the first N conversations.")] = None,
    max_turns: Annotated[int | None, typer.Option(min=1, help="Turns per conversation.")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="max_tokens of every request.")] = 16,
    model: Annotated[str | None, typer.Option(
        help="Tokenizer for the ideal prefill: model dir or qwen3/llama3/mistral/gpt-oss "
             "(default: the default model).")] = None,
    adapter: Adapter = "auto",
    canonical_tools: CanonicalTools = False,
    out: Annotated[Path, typer.Option(help="Writes OUT.json (report) and OUT.png (plot).")]
    = Path("bench/results/anchorcache_bench"),
) -> None:
    """Replay conversations through a running proxy, anchors on vs off; JSON report + PNG.

    Exit codes: 0 done, 1 some reply differed between anchors on and off, 2 bad input,
    3 a proxy unreachable or failing.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from anchorcache import bench as b
    from anchorcache.proxy.splitter import get_adapter
    from anchorcache.proxy.splitter.tokenizers import load_tokenizer

    console = Console(stderr=True)
    try:
        convs = b.load_conversations(conversations)[:limit]
        # split as the proxy does (same adapter and tool order), to count the ideal in its tokens
        splitter = get_adapter(adapter, load_tokenizer(model), canonical_tools=canonical_tools)
    except (b.BenchError, ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    on = b.BenchTarget(url, api_key=api_key)
    off = b.BenchTarget(baseline_url, api_key=api_key) if baseline_url else \
        b.BenchTarget(url, anchors_off=True, api_key=api_key)
    total = sum(len(b.turn_requests(c, max_turns)) for c in convs)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("replaying", total=total)
            results = b.replay(
                convs, on, off, max_turns=max_turns, max_tokens=max_tokens,
                tokenize=lambda msgs, tools: splitter.split(msgs, tools or None).input_ids,
                on_turn=lambda r: progress.update(
                    task, advance=1, description=f"{r.conversation} t{r.turn}"))
        model_id = b.model_id(on)
    except b.BenchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(3) from None
    data = b.report(results, model=model_id, meta={
        "url": url, "baseline": baseline_url or f"{url} (anchors off per request)",
        "conversations_file": str(conversations), "max_turns": max_turns,
        "max_tokens": max_tokens})
    table = Table(*b.TABLE_COLUMNS, title=f"anchorcache bench: {model_id}")
    for row in b.table_rows(results):
        table.add_row(*row)
    out_console = Console()
    if not out_console.is_terminal:  # piped: do not squeeze the table into 80 columns
        out_console = Console(width=160)
    out_console.print(table)
    out_console.print_json(data=data["summary"])
    stem = out.with_suffix("") if out.suffix in (".json", ".png") else out
    json_path, png_path = Path(f"{stem}.json"), Path(f"{stem}.png")
    b.write_json(data, json_path)
    typer.echo(f"wrote {json_path}", err=True)
    try:
        b.plot(results, png_path, f"{model_id}: {len(convs)} conversations")
        typer.echo(f"wrote {png_path}", err=True)
    except ImportError:
        typer.echo("no PNG: matplotlib is not installed (pip install 'anchorcache[bench]')",
                   err=True)
    if data["summary"]["mismatches"]:
        typer.echo(f"{data['summary']['mismatches']} replies differed between anchors on and off",
                   err=True)
        raise typer.Exit(1)


def _mount_ops() -> None:
    from anchorcache.ops.cli import app as ops_app

    app.add_typer(ops_app, name="ops")


_mount_ops()


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()


if __name__ == "__main__":
    main()
