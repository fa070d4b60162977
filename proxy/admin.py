"""The admin API (`/admin/*`): tenants and keys, toolsets and pinning, anchors, slots, stats.

Guarded by its own token (`ANCHORCACHE_ADMIN_TOKEN`, compared in constant time); a tenant
key gets 403, anything else 401, and with no admin token configured the API is off (403).
Everything goes through the ledger and the anchor life cycle; `ops/` is its client.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
from collections import Counter
from typing import Any

import orjson
from aiohttp import web

from anchorcache.state.ledger import LedgerError
from anchorcache.state.records import AnchorStatus, Quotas, Toolset

from .errors import ApiError, json_response
from .running import STATE, ProxyState
from .splitter.types import CutKind, SplitError
from .targets import Target
from .tenants import TENANTS, TenantContext, bearer
from .toolsets import SHARED_TENANT

log = logging.getLogger("anchorcache.proxy")

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
LEADING_ROLES = ("system", "developer")


def is_admin(request: web.Request) -> bool:
    """Whether `request` carries the admin token (the admin API is on)."""
    token, given = request.app[STATE].config.admin_token, bearer(request)
    if not token or given is None:
        return False
    return hmac.compare_digest(given.encode(), token.encode())


@web.middleware
async def admin_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    if not request.path.startswith("/admin"):
        return await handler(request)
    token = request.app[STATE].config.admin_token
    if not token:
        raise ApiError("permission_denied", "the admin API is off: start the proxy with "
                       "ANCHORCACHE_ADMIN_TOKEN set")
    given = bearer(request)
    if given is None:
        raise ApiError("unauthorized", "the admin API needs 'Authorization: Bearer ADMIN_TOKEN'")
    if not hmac.compare_digest(given.encode(), token.encode()):
        if request.app[TENANTS].ledger.lookup_key(given) is not None:
            raise ApiError("permission_denied", "a tenant API key cannot use the admin API")
        raise ApiError("invalid_api_key", "incorrect admin token")
    return await handler(request)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read() or b"{}")
    except orjson.JSONDecodeError as e:
        raise ApiError("invalid_json", f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("invalid_request", "the request body must be a JSON object")
    return body


def _state(request: web.Request) -> ProxyState:
    return request.app[STATE]


def _tenant_name(request: web.Request) -> str:
    name = request.match_info["name"]
    if _state(request).ledger.tenant(name) is None or name == SHARED_TENANT:
        raise ApiError("not_found", f"no tenant {name!r}")
    return name


def _quotas(body: dict[str, Any], base: Quotas) -> Quotas:
    values = {}
    for field in ("max_pinned_toolsets", "max_anchor_bytes", "max_in_flight"):
        v = body.get(field, getattr(base, field))
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ApiError("invalid_request", f"'{field}' must be a non-negative integer or null",
                           param=field)
        values[field] = v
    return Quotas(**values)


# ---- tenants and keys ---------------------------------------------------------------------
async def create_tenant(request: web.Request) -> web.Response:
    body = await _json_body(request)
    name = body.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ApiError("invalid_request", "'name' must be 1-64 letters, digits, '_', '.' or '-'",
                       param="name")
    state = _state(request)
    try:
        tenant, key_id, api_key = state.ledger.create_tenant(
            name, _quotas(body.get("quotas") or {}, state.config.default_quotas))
    except LedgerError as e:
        raise ApiError("conflict", str(e), param="name") from None
    return json_response({"name": tenant.name, "api_key": api_key, "key_id": key_id,
                          "quotas": tenant.quotas.to_json()})


async def list_tenants(request: web.Request) -> web.Response:
    state = _state(request)
    led, in_flight = state.ledger, request.app[TENANTS].in_flight_now()
    out = []
    for t in led.tenants():
        if t.name == SHARED_TENANT:
            continue
        out.append({**t.to_json(), "keys": [k.to_json() for k in led.keys(t.name)],
                    "in_flight": in_flight.get(t.name, 0),
                    "anchor_bytes": sum(led.anchor_bytes(t.name, w.id, w.lifecycle.epoch)
                                        for w in state.targets.all),
                    "toolsets": len(led.toolsets(t.name)),
                    "pinned_toolsets": len(led.toolsets(t.name, pinned=True))})
    return json_response({"data": out})


async def set_quotas(request: web.Request) -> web.Response:
    name = _tenant_name(request)
    led = _state(request).ledger
    tenant = led.tenant(name)
    assert tenant is not None
    return json_response(led.set_quotas(name, _quotas(await _json_body(request), tenant.quotas)).to_json())


async def add_key(request: web.Request) -> web.Response:
    key_id, api_key = _state(request).ledger.add_key(_tenant_name(request))
    return json_response({"api_key": api_key, "key_id": key_id})


async def revoke_key(request: web.Request) -> web.Response:
    name, key_id = _tenant_name(request), request.match_info["key_id"]
    if not _state(request).ledger.revoke_key(name, key_id):
        raise ApiError("not_found", f"tenant {name!r} has no key {key_id!r}")
    return json_response({"key_id": key_id, "revoked": True})


# ---- toolsets and pinning -----------------------------------------------------------------
def _instruction_ids(state: ProxyState, body: dict[str, Any]) -> tuple[int, ...]:
    messages, tools = body.get("messages"), body.get("tools") or []
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in LEADING_ROLES for m in messages):
        raise ApiError("invalid_request", "'messages' must be a list of the leading system/"
                       "developer messages", param="messages")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ApiError("invalid_request", "'tools' must be a list of tool objects", param="tools")
    if not messages and not tools:
        raise ApiError("invalid_request", "a toolset needs leading messages or tools",
                       param="messages")
    # Render with a user turn after them (some templates refuse to render without one) and
    # keep what comes before the instruction cut: exactly the prefix real requests start with.
    probe = [dict(m) for m in messages] + [{"role": "user", "content": "."}]
    try:
        split = state.adapter.split(probe, [dict(t) for t in tools] or None)
    except SplitError as e:
        raise ApiError("invalid_request", str(e)) from None
    cut = next((c.position for c in split.cuts if c.kind == CutKind.INSTRUCTION), None)
    if cut is None or cut < 1:
        raise ApiError("invalid_request", "these messages and tools give no instruction cut "
                       "with this model's template", param="messages")
    return split.input_ids[:cut]


def _flag(body: dict[str, Any], name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise ApiError("invalid_request", f"'{name}' must be a boolean", param=name)
    return v


def _check_pin(state: ProxyState, ts: Toolset) -> None:
    """Per-tenant pinned-toolset quota and the global pin budget (429 past them)."""
    led = state.ledger
    tenant = led.tenant(ts.tenant)
    assert tenant is not None
    pinned = [t for t in led.toolsets(ts.tenant, pinned=True) if t.toolset != ts.toolset]
    limit = tenant.quotas.max_pinned_toolsets
    if limit is not None and len(pinned) >= limit:
        raise ApiError("quota_exceeded", f"tenant {ts.tenant!r} may pin {limit} toolsets "
                       "(its quota); unpin one first")
    for target in state.targets.all:  # the budget is per worker (its memory)
        lc = target.lifecycle
        used = sum(rec.nbytes for t in led.toolsets(pinned=True) if t.toolset != ts.toolset
                   for _, _, key in lc.toolsets.keys(t) if (rec := lc.live(key)) is not None)
        mine = sum(rec.nbytes for _, _, key in lc.toolsets.keys(ts)
                   if (rec := lc.live(key)) is not None)
        if used + mine > state.config.pin_budget_bytes:
            raise ApiError("quota_exceeded", f"pinning this toolset ({mine} bytes) would exceed "
                           f"the global pin budget on worker {target.name} ({used} of "
                           f"{state.config.pin_budget_bytes} bytes used)")


async def _unshare(state: ProxyState, ts: Toolset) -> Toolset:
    """Stop sharing `ts`: its copy in the shared namespace is evicted from every worker
    (pinned or not), so no other tenant's chain can start there any more, unless another
    toolset with the same instruction prefix is still shared."""
    shared_keys = [key for target in state.targets.all
                   for tenant, _, key in target.lifecycle.toolsets.keys(ts)
                   if tenant == SHARED_TENANT]
    ts = state.ledger.set_toolset(ts.toolset, shared=False)
    if any(other.input_ids == ts.input_ids for other in state.ledger.toolsets() if other.shared):
        return ts
    for target in state.targets.all:
        for key in set(shared_keys):
            try:
                await target.lifecycle.evict(key)
            except ApiError as e:  # out of reach: its restart forgets the anchor anyway
                log.warning("unsharing %s: evicting its shared copy on %s failed: %s",
                            ts.toolset, target.name, e.message)
    return ts


async def _apply(state: ProxyState, ts: Toolset, pin: bool | None, shared: bool | None) -> Toolset:
    led, serving = state.ledger, state.targets.serving()
    if shared is False and ts.shared:
        ts = await _unshare(state, ts)
    elif shared is not None and shared != ts.shared:
        ts = led.set_toolset(ts.toolset, shared=shared)
    for t in serving:  # warm (shared copy too) before pinning: the pin needs the bytes
        await t.lifecycle.toolsets.ensure(ts)
    if pin:
        _check_pin(state, ts)
        ts = led.set_toolset(ts.toolset, pinned=True)
        for t in serving:  # pinned toolsets are warm on every worker
            await t.lifecycle.toolsets.ensure(ts)
    elif pin is False and ts.pinned:
        ts = led.set_toolset(ts.toolset, pinned=False)
        for t in serving:
            await t.lifecycle.toolsets.unpin(ts)
    led.event("toolset", ts.tenant, toolset=ts.toolset, pinned=ts.pinned, shared=ts.shared)
    return ts


def _toolset_json(ts: Toolset) -> dict[str, Any]:
    return {**ts.to_json(), "anchor": {"key": ts.toolset, "depth": ts.depth}}


async def create_toolset(request: web.Request) -> web.Response:
    name = _tenant_name(request)
    state = _state(request)
    body = await _json_body(request)
    pin, shared = _flag(body, "pin"), _flag(body, "shared")
    ids = _instruction_ids(state, body)
    tenant = state.ledger.tenant(name)
    assert tenant is not None
    ns = TenantContext(tenant).caller().namespace
    serving = state.targets.serving()
    if not serving:
        raise ApiError("worker_unavailable", "no worker is serving: the toolset cannot be warmed")
    recs = [await t.lifecycle.warm(name, ns, ids) for t in serving]
    ts = state.ledger.put_toolset(name, ns, recs[0].key, ids)
    ts = await _apply(state, ts, pin, shared)
    return json_response(_toolset_json(ts))


async def list_toolsets(request: web.Request) -> web.Response:
    tenant = request.query.get("tenant")
    targets = _state(request).targets.all
    out = []
    for ts in _state(request).ledger.toolsets(tenant):
        warm_on = [t.name for t in targets if t.lifecycle.live(ts.key) is not None]
        out.append({**_toolset_json(ts), "warm": bool(warm_on), "warm_on": warm_on})
    return json_response({"data": out})


async def _toolset_arg(request: web.Request) -> tuple[Toolset, dict[str, Any]]:
    body = await _json_body(request)
    tid = body.get("toolset")
    ts = _state(request).ledger.toolset(tid) if isinstance(tid, str) else None
    if ts is None:
        raise ApiError("not_found", f"no toolset {tid!r}", param="toolset")
    return ts, body


async def pin(request: web.Request) -> web.Response:
    ts, _ = await _toolset_arg(request)
    return json_response(_toolset_json(await _apply(_state(request), ts, True, None)))


async def unpin(request: web.Request) -> web.Response:
    ts, _ = await _toolset_arg(request)
    return json_response(_toolset_json(await _apply(_state(request), ts, False, None)))


async def share(request: web.Request) -> web.Response:
    ts, body = await _toolset_arg(request)
    shared = _flag(body, "shared")
    return json_response(_toolset_json(await _apply(_state(request), ts, None,
                                                    True if shared is None else shared)))


# ---- anchors, slots, stats ----------------------------------------------------------------
async def anchors(request: web.Request) -> web.Response:
    state = _state(request)
    status = request.query.get("status", "committed")
    try:
        st = None if status == "all" else AnchorStatus(status)
    except ValueError:
        raise ApiError("invalid_request", f"unknown status {status!r}", param="status") from None
    everywhere = request.query.get("epoch") == "all"
    tenant = request.query.get("tenant") or None
    targets = _targets(request)
    if everywhere:  # every epoch: of the worker asked for, or of any worker ever
        rows = state.ledger.anchors(tenant=tenant, status=st, worker=targets[0].id
                                    if "worker" in request.query else None)
    else:  # each worker's current epoch
        rows = [r for t in targets for r in state.ledger.anchors(
            tenant=tenant, status=st, worker=t.id, epoch=t.lifecycle.epoch)]
    return json_response({"data": [r.to_json() for r in rows if r.tenant != SHARED_TENANT
                                   or request.query.get("tenant") in (None, SHARED_TENANT)]})


async def slots(request: web.Request) -> web.Response:
    """Every worker's slots (`?worker=NAME|URL`: one worker's); a worker that does not
    answer is skipped unless it was asked for by name."""
    state = _state(request)
    out, epochs = [], {}
    for t in _targets(request):
        try:
            listing = await t.worker.slots()  # its life cycle observed its epoch
        except ApiError:
            if "worker" in request.query:
                raise
            continue
        epochs[t.name] = listing.epoch
        rows = {r.key: r for r in state.ledger.anchors(worker=t.id, epoch=listing.epoch)}
        for s in listing.slots:
            r = rows.get(s.key)
            out.append({"slot": s.slot, "key": s.key.hex(), "depth": s.depth,
                        "parent": s.parent.hex() if s.parent else None, "bytes": s.nbytes,
                        "state": s.state, "pinned": s.pinned, "hits": s.hits,
                        "last_use": s.last_use, "kind": r.kind if r else None,
                        "tenant": r.tenant if r else None,
                        "ledger_hits": r.hits if r else None,
                        "last_hit": r.last_hit if r else None, "epoch": listing.epoch,
                        "worker": t.name, "tier": s.tier})
        for d in listing.disk:  # on the worker's disk tier only (docs/disk-tier.md)
            r = rows.get(d.key)
            out.append({"slot": None, "key": d.key.hex(), "depth": d.depth,
                        "parent": d.parent.hex() if d.parent else None, "bytes": d.nbytes,
                        "state": "committed", "pinned": d.pinned, "hits": 0, "last_use": None,
                        "kind": r.kind if r else None, "tenant": r.tenant if r else None,
                        "ledger_hits": r.hits if r else None,
                        "last_hit": r.last_hit if r else None, "epoch": listing.epoch,
                        "worker": t.name, "tier": "disk"})
    if not epochs:
        raise ApiError("worker_unavailable", "no worker listed its slots")
    return json_response({"data": out, "epoch": next(iter(epochs.values())), "epochs": epochs})


async def evict(request: web.Request) -> web.Response:
    body = await _json_body(request)
    try:
        key = bytes.fromhex(body["key"])
    except (KeyError, TypeError, ValueError):
        raise ApiError("invalid_request", "'key' must be a hex anchor key", param="key") from None
    evicted = False
    for t in _targets(request):
        evicted = await t.lifecycle.evict(key) or evicted
    return json_response({"key": key.hex(), "evicted": evicted})


async def stats(request: web.Request) -> web.Response:
    """The ledger's numbers, and the first serving worker's (`worker`, `epoch`...) with
    every worker's under `workers`. `requests` and the routing counts are the answering
    process's (`process`: which of how many, its pid; /metrics sums every process)."""
    state = _state(request)
    workers, requests = [], Counter[str]()
    primary, first = state.targets.primary, None
    for t in state.targets.all:
        try:
            stats: dict[str, Any] | None = await t.worker.stats()
        except ApiError:
            stats = None
        workers.append({**t.to_json(), "stats": stats})
        requests.update(t.lifecycle.counters)
        if t is primary:
            first = stats
    lc = primary.lifecycle
    return json_response({"ledger": {**state.ledger.stats(), "size": state.ledger.size()},
                          "worker": first,
                          "requests": dict(requests),
                          "epoch": lc.epoch, "worker_url": lc.worker_id, "workers": workers,
                          "in_flight": request.app[TENANTS].in_flight_now(),
                          "process": {"index": state.config.process_index,
                                      "of": state.config.processes, "pid": os.getpid()},
                          "last_reconcile": lc.last_reconcile.to_json() if lc.last_reconcile else None})


async def reconcile(request: web.Request) -> web.Response:
    """Reconcile the ledger with every worker (`?worker=`: one); the first one's report at
    the top level, each one's under `workers`."""
    reports = {t.name: await t.lifecycle.reconcile("admin") for t in _targets(request)}
    first = next(iter(reports.values()), None)
    body = first.to_json() if first else {"error": "no slot listing"}
    return json_response({**body, "workers": {name: r.to_json() if r else None
                                              for name, r in reports.items()}})


# ---- workers (targets) ---------------------------------------------------------------------
def _targets(request: web.Request) -> list[Target]:
    """The workers a request names (`?worker=NAME|URL`), or all of them."""
    targets = _state(request).targets
    wanted = request.query.get("worker")
    if wanted is None:
        return list(targets.all)
    target = targets.find(wanted)
    if target is None:
        raise ApiError("not_found", f"no worker {wanted!r}", param="worker")
    return [target]


async def list_workers(request: web.Request) -> web.Response:
    targets = _state(request).targets
    await targets.check_all()  # fresh health and load
    return json_response({"data": [t.to_json() for t in targets.all],
                          "route": _state(request).config.route})


def _one_process(state: ProxyState) -> None:
    """Workers are added and removed in one process's memory: with several processes the
    others would never route to (or stop routing to) it, so the change is refused."""
    if state.config.processes > 1:
        raise ApiError("conflict", f"this proxy runs {state.config.processes} processes: "
                       "workers are changed by restarting it with the new --worker list (or "
                       "with --processes 1, which changes them live)")


async def add_worker(request: web.Request) -> web.Response:
    """Add a worker; with `warm_from` (a worker's name or URL), then copy that worker's
    disk-tier files into the new one's and reconcile it (`_warm`)."""
    _one_process(_state(request))
    body = await _json_body(request)
    url, warm_from = body.get("url"), body.get("warm_from")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ApiError("invalid_request", "'url' must be the worker's http(s) base URL",
                       param="url")
    state = _state(request)
    source = None
    if warm_from is not None:
        source = state.targets.find(warm_from) if isinstance(warm_from, str) else None
        if source is None:
            raise ApiError("not_found", f"no worker {warm_from!r} to warm from",
                           param="warm_from")
    added = await state.targets.add(url)
    warmed = {t.name: await _warm(state, source, t) for t in added} if source else None
    # the first target's fields (one for a plain worker), and every target added (a server of
    # data-parallel ranks adds one per rank)
    return json_response({**added[0].to_json(), "targets": [t.to_json() for t in added],
                          **({"warmed": warmed} if warmed is not None else {})})


async def _warm(state: ProxyState, source: Target, dest: Target) -> dict[str, int]:
    """Copy the slab files of `source`'s committed anchors (parents first) into `dest`'s disk
    tier over the contract (`/anchor/export`, `/anchor/import`), then reconcile `dest`, whose
    ledger recovery adopts them for the tenants that wrote them. Counts: `copied`, `held`
    (there already), `missing` (no file to export: not written yet, or no disk tier),
    `refused` (the import failed a check, or `dest` has no disk tier), `bytes`."""
    counts = Counter(copied=0, held=0, missing=0, refused=0, bytes=0)
    rows = state.ledger.anchors(worker=source.id, epoch=source.lifecycle.epoch,
                                status=AnchorStatus.COMMITTED)  # by depth: parents first
    for key in dict.fromkeys(r.key for r in rows):
        try:
            data = await source.worker.export_slab(key)
        except ApiError:
            counts["missing"] += 1
            continue
        try:
            reply = await dest.worker.import_slab(data)
        except ApiError as e:
            counts["refused"] += 1
            log.warning("warming %s from %s: an import was refused: %s", dest.name,
                        source.name, e.message)
            continue
        counts["copied" if reply.imported else "held"] += 1
        counts["bytes"] += len(data)
    await dest.lifecycle.reconcile("warm")
    return dict(counts)


async def remove_worker(request: web.Request) -> web.Response:
    """Drain a worker (no new requests; its in-flight ones finish) and remove it."""
    state = _state(request)
    _one_process(state)
    target = state.targets.find(request.match_info["name"])
    if target is None:
        raise ApiError("not_found", f"no worker {request.match_info['name']!r}")
    if len(state.targets.all) == 1:
        raise ApiError("conflict", "the last worker cannot be removed")
    in_flight = target.in_flight
    drained = await state.targets.drain(target, state.config.drain_timeout_s)
    return json_response({**target.to_json(), "removed": True, "drained": drained,
                          "in_flight_at_drain": in_flight})


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/admin/tenants", create_tenant)
    r.add_get("/admin/tenants", list_tenants)
    r.add_post("/admin/tenants/{name}/quotas", set_quotas)
    r.add_post("/admin/tenants/{name}/keys", add_key)
    r.add_delete("/admin/tenants/{name}/keys/{key_id}", revoke_key)
    r.add_post("/admin/tenants/{name}/toolsets", create_toolset)
    r.add_get("/admin/toolsets", list_toolsets)
    r.add_get("/admin/anchors", anchors)
    r.add_get("/admin/slots", slots)
    r.add_post("/admin/evict", evict)
    r.add_post("/admin/pin", pin)
    r.add_post("/admin/unpin", unpin)
    r.add_post("/admin/share", share)
    r.add_get("/admin/stats", stats)
    r.add_post("/admin/reconcile", reconcile)
    r.add_get("/admin/workers", list_workers)
    r.add_post("/admin/workers", add_worker)
    r.add_delete("/admin/workers/{name}", remove_worker)
