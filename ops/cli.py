"""`anchorcache ops ...`: the operator's view over the proxy's admin API (typer + rich).

Tables for people, `--json` for scripts. Exit codes: 0 ok, 1 the proxy refused the
request, 2 bad usage, 3 proxy unreachable, 4 admin token missing or wrong, 5 not found.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.progress import Progress
from rich.table import Table

from .client import AdminClient, OpsError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Operate a running proxy over its /admin API (exit codes: 0 ok, 1 refused, "
                       "2 usage, 3 unreachable, 4 bad token, 5 not found).")

Url = Annotated[str, typer.Option(envvar="ANCHORCACHE_URL", help="Proxy base URL.")]
Token = Annotated[str | None, typer.Option(envvar="ANCHORCACHE_ADMIN_TOKEN", show_default=False,
                                           help="Admin token.")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
DEFAULT_URL = "http://127.0.0.1:8000"


def _run(action: Callable[[], None]) -> None:
    try:
        action()
    except OpsError as e:
        Console(stderr=True).print(f"[red]error:[/red] {e.message}", highlight=False, soft_wrap=True)
        raise typer.Exit(e.exit_code) from None


def _emit(data: Any, as_json: bool, table: Callable[[], Table | str]) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        Console().print(table())


def _ts(t: float | None) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _short(key: str | None) -> str:
    return key[:12] if key else "-"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[str(v) for v in r])
    return t


@app.command()
def slots(url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False) -> None:
    """The worker's slots, joined with the ledger (tenant, kind, hits)."""
    def go() -> None:
        data = AdminClient(url, token).get("/admin/slots")
        _emit(data, as_json, lambda: _table(
            f"slots (epoch {data['epoch'][:8]})",
            ["worker", "tier", "slot", "kind", "tenant", "depth", "parent", "bytes", "pinned",
             "hits", "last use", "state", "key"],
            [[s.get("worker", "-"), s.get("tier", "host"), "-" if s["slot"] is None else s["slot"],
              s["kind"] or "?", s["tenant"] or "?", s["depth"], _short(s["parent"]),
              _bytes(s["bytes"]), "yes" if s["pinned"] else "", s["hits"],
              "-" if s["last_use"] is None else s["last_use"], s["state"], _short(s["key"])]
             for s in data["data"]]))
    _run(go)


@app.command()
def anchors(url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False,
            tenant: Annotated[str | None, typer.Option(help="Only this tenant's.")] = None,
            status: Annotated[str, typer.Option(help="committed, reserved, aborted, evicted, "
                                                     "lost or all.")] = "committed") -> None:
    """Anchors in the ledger (this worker epoch)."""
    def go() -> None:
        data = AdminClient(url, token).get("/admin/anchors", tenant=tenant, status=status)
        _emit(data, as_json, lambda: _table(
            "anchors", ["key", "tenant", "kind", "depth", "parent", "slot", "bytes", "status",
                        "hits", "last hit"],
            [[_short(a["key"]), a["tenant"], a["kind"], a["depth"], _short(a["parent"]), a["slot"],
              _bytes(a["nbytes"]), a["status"], a["hits"], _ts(a["last_hit"])]
             for a in data["data"]]))
    _run(go)


@app.command()
def tenants(url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False) -> None:
    """Tenants with their keys, quotas and usage."""
    def go() -> None:
        data = AdminClient(url, token).get("/admin/tenants")
        _emit(data, as_json, lambda: _table(
            "tenants", ["name", "keys", "in flight", "anchor bytes", "toolsets", "pinned",
                        "max in flight", "max pinned", "max bytes"],
            [[t["name"], sum(not k["revoked"] for k in t["keys"]), t["in_flight"],
              _bytes(t["anchor_bytes"]), t["toolsets"], t["pinned_toolsets"],
              t["quotas"]["max_in_flight"] or "-", t["quotas"]["max_pinned_toolsets"] or "-",
              _bytes(t["quotas"]["max_anchor_bytes"])] for t in data["data"]]))
    _run(go)


@app.command("tenant-add")
def tenant_add(name: str, url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False) -> None:
    """Create a tenant; prints its first API key (shown once)."""
    def go() -> None:
        data = AdminClient(url, token).post("/admin/tenants", {"name": name})
        _emit(data, as_json, lambda: f"tenant {data['name']}: api key {data['api_key']} "
                                     f"(id {data['key_id']}; shown once)")
    _run(go)


@app.command("key-add")
def key_add(tenant: str, url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False) -> None:
    """A new API key for a tenant (shown once)."""
    def go() -> None:
        data = AdminClient(url, token).post(f"/admin/tenants/{tenant}/keys")
        _emit(data, as_json, lambda: f"api key {data['api_key']} (id {data['key_id']}; shown once)")
    _run(go)


@app.command("key-revoke")
def key_revoke(tenant: str, key_id: str, url: Url = DEFAULT_URL, token: Token = None,
               as_json: Json = False) -> None:
    """Revoke one of a tenant's keys."""
    def go() -> None:
        data = AdminClient(url, token).delete(f"/admin/tenants/{tenant}/keys/{key_id}")
        _emit(data, as_json, lambda: f"revoked {key_id}")
    _run(go)


@app.command()
def toolsets(url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False,
             tenant: Annotated[str | None, typer.Option(help="Only this tenant's.")] = None) -> None:
    """Toolsets (leading instructions + tools) seen or warmed, with their pin state."""
    def go() -> None:
        data = AdminClient(url, token).get("/admin/toolsets", tenant=tenant)
        _emit(data, as_json, lambda: _table(
            "toolsets", ["toolset", "tenant", "depth", "pinned", "shared", "warm", "created"],
            [[t["toolset"], t["tenant"], t["depth"], "yes" if t["pinned"] else "",
              "yes" if t["shared"] else "", "yes" if t["warm"] else "", _ts(t["created_at"])]
             for t in data["data"]]))
    _run(go)


def _toolset_op(path: str, toolset: str, url: str, token: str | None, as_json: bool) -> None:
    def go() -> None:
        data = AdminClient(url, token).post(path, {"toolset": toolset})
        _emit(data, as_json, lambda: f"toolset {data['toolset']}: pinned={data['pinned']} "
                                     f"shared={data['shared']}")
    _run(go)


@app.command()
def pin(toolset: str, url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False) -> None:
    """Pin a toolset: its instruction anchor is never evicted by other traffic."""
    _toolset_op("/admin/pin", toolset, url, token, as_json)


@app.command()
def unpin(toolset: str, url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False) -> None:
    """Unpin a toolset."""
    _toolset_op("/admin/unpin", toolset, url, token, as_json)


def _workers_view(data: dict[str, Any]) -> Table:
    return _table(
        f"workers (routing: {data['route']})",
        ["name", "url", "health", "load", "in flight", "routed", "anchors", "bytes", "hit rate",
         "epoch"],
        [[w["name"], w["url"],
          "draining" if w["draining"] else "ok" if w["healthy"] else f"out: {w['error']}",
          w["load"], w["in_flight"], w["routed"], w["anchors"], _bytes(w["bytes"]),
          "-" if w["hit_rate"] is None else f"{w['hit_rate']:.0%}", (w["epoch"] or "-")[:8]]
         for w in data["data"]])


@app.command()
def workers(url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False) -> None:
    """The workers behind the proxy: health, load, anchors, bytes and hit rate."""
    def go() -> None:
        data = AdminClient(url, token).get("/admin/workers")
        _emit(data, as_json, lambda: _workers_view(data))
    _run(go)


@app.command("worker-add")
def worker_add(worker_url: Annotated[str, typer.Argument(help="The worker's base URL.")],
               warm_from: Annotated[str | None, typer.Option(
                   help="A worker (name or URL) whose disk-tier files are copied into the new "
                        "one as it is added (docs/disk-tier.md).")] = None,
               url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False) -> None:
    """Add a worker live (it must serve the proxy's model)."""
    def go() -> None:
        body = {"url": worker_url, **({"warm_from": warm_from} if warm_from else {})}
        data = AdminClient(url, token).post("/admin/workers", body)
        warmed = data.get("warmed") or {}

        def line(t: dict[str, Any]) -> str:
            text = f"worker {t['name']} added: {t['url']} (epoch {t['epoch'][:8]})"
            if (w := warmed.get(t["name"])) is not None:
                text += (f", warmed from {warm_from}: {w['copied']} files copied "
                         f"({_bytes(w['bytes'])}), {w['held']} held already, "
                         f"{w['missing']} missing, {w['refused']} refused")
            return text
        _emit(data, as_json, lambda: "\n".join(line(t) for t in data.get("targets", [data])))
    _run(go)


@app.command("worker-remove")
def worker_remove(name: Annotated[str, typer.Argument(help="The worker's name (w1) or URL.")],
                  url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False) -> None:
    """Drain a worker (its in-flight requests finish, nothing new goes to it) and remove it."""
    def go() -> None:
        client = AdminClient(url, token)
        target = name
        if name.startswith(("http://", "https://")):  # a URL: its name
            listed = client.get("/admin/workers")["data"]
            target = next((w["name"] for w in listed if w["url"] == name.rstrip("/")), "")
            if not target:
                raise OpsError(f"no worker {name}", 5)
        data = client.delete(f"/admin/workers/{target}")
        _emit(data, as_json, lambda: f"worker {data['name']} removed "
                                     f"({'drained' if data['drained'] else 'drain timed out'})")
    _run(go)


@app.command()
def evict(key: str, url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False) -> None:
    """Evict one anchor (by key hex) from the worker now."""
    def go() -> None:
        data = AdminClient(url, token).post("/admin/evict", {"key": key})
        if not data["evicted"]:
            raise OpsError(f"no anchor {key} is held", 5)
        _emit(data, as_json, lambda: f"evicted {key}")
    _run(go)


@app.command()
def warm(tenant: str,
         file: Annotated[Path, typer.Argument(help="JSON: {messages, tools} or a list of them.")],
         url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False,
         pin_: Annotated[bool, typer.Option("--pin", help="Pin them too.")] = False,
         shared: Annotated[bool, typer.Option("--shared", help="Share them with every tenant.")] = False,
         ) -> None:
    """Pre-compute a tenant's toolset anchors from a JSON file of leading messages + tools."""
    def go() -> None:
        try:
            spec = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise OpsError(f"cannot read {file}: {e}", 2) from None
        items = spec if isinstance(spec, list) else [spec]
        client = AdminClient(url, token)
        out = []
        with Progress(console=Console(stderr=True), transient=as_json) as progress:
            task = progress.add_task(f"warming {len(items)} toolset(s)", total=len(items))
            for item in items:
                if not isinstance(item, dict):
                    raise OpsError(f"{file}: each toolset must be an object with messages/tools", 2)
                out.append(client.post(f"/admin/tenants/{tenant}/toolsets",
                                       {"messages": item.get("messages", []),
                                        "tools": item.get("tools", []), "pin": pin_,
                                        "shared": shared}))
                progress.advance(task)
        _emit({"data": out}, as_json, lambda: _table(
            "warmed", ["toolset", "depth", "pinned", "shared"],
            [[t["toolset"], t["anchor"]["depth"], t["pinned"], t["shared"]] for t in out]))
    _run(go)


def _stats_view(data: dict[str, Any]) -> Table:
    led, req = data["ledger"], data.get("requests") or {}
    worker = data.get("worker") or {}
    t = Table(title=f"anchorcache stats (epoch {str(data['epoch'])[:8]})", show_header=False)
    t.add_column("what")
    t.add_column("value")
    prompt, cached = req.get("prompt_tokens", 0), req.get("cached_tokens", 0)
    rows = [
        ("requests", req.get("count", 0)),
        ("hit rate (requests restoring anything)",
         f"{req.get('hits', 0) / req['count']:.1%}" if req.get("count") else "-"),
        ("tokens saved (restored)", f"{cached} of {prompt} prompt tokens"
         + (f" ({cached / prompt:.1%})" if prompt else "")),
        ("bytes held (committed anchors)", _bytes(led["bytes_committed"])),
        ("anchors by status", ", ".join(f"{k} {v}" for k, v in sorted(led["anchors"].items())) or "-"),
        ("reservations", ", ".join(f"{k} {v}" for k, v in sorted(led["reservations"].items())) or "-"),
        ("aborted by reason", ", ".join(f"{k or '?'} {v}" for k, v in
                                        sorted(led["aborted_by_reason"].items())) or "-"),
        ("worker slots used", f"{worker.get('used_slots', '-')} of {worker.get('num_slots', '-')}"),
        ("worker bytes", f"{_bytes(worker.get('bytes_used'))} of {_bytes(worker.get('bytes_capacity'))}"),
        ("tenants / toolsets / pinned", f"{led['tenants']} / {led['toolsets']} / {led['pinned_toolsets']}"),
    ]
    disk = worker.get("disk")
    if disk:  # a worker with a disk tier (docs/disk-tier.md)
        rows.append(("worker disk tier", (
            f"{disk['files']} files, {_bytes(disk['bytes'])} of {_bytes(disk['budget_bytes'])}"
            if disk["enabled"] else "off (disk full or read-only)")))
        rows.append(("worker disk loads / imports / skips / writes / evictions",
                     f"{disk['loads']} / {disk.get('imports', 0)} / {disk['skips']} / "
                     f"{disk['writes']} / {disk['evictions']}"))
    size = led.get("size")
    if size:  # (a proxy that reports it)
        rows.append(("ledger on disk", f"{_bytes(size['file_bytes'])}: " + ", ".join(
            f"{k.removesuffix('_rows')} {v}" for k, v in size.items() if k.endswith("_rows"))))
    for k, v in rows:
        t.add_row(k, str(v))
    return t


@app.command()
def stats(url: Url = DEFAULT_URL, token: Token = None, as_json: Json = False) -> None:
    """Hit rate, tokens saved, bytes held, reservations aborted by reason."""
    def go() -> None:
        data = AdminClient(url, token).get("/admin/stats")
        _emit(data, as_json, lambda: _stats_view(data))
    _run(go)


@app.command()
def watch(url: Url = DEFAULT_URL, token: Token = None,
          interval: Annotated[float, typer.Option(min=0.2, help="Seconds between refreshes.")] = 2.0,
          count: Annotated[int | None, typer.Option(help="Stop after this many refreshes.")] = None,
          ) -> None:
    """Live-refreshing stats (Ctrl-C stops)."""
    def go() -> None:
        client = AdminClient(url, token)
        with Live(_stats_view(client.get("/admin/stats")), refresh_per_second=4) as live:
            n = 1
            while count is None or n < count:
                time.sleep(interval)
                live.update(_stats_view(client.get("/admin/stats")))
                n += 1
    try:
        _run(go)
    except KeyboardInterrupt:
        pass
