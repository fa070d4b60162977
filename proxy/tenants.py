"""Tenants: `Authorization: Bearer KEY` → tenant, anonymous access, in-flight quotas.

One middleware for every API route (`/v1/...`, OpenAI and Anthropic alike): it resolves the
caller before any handler runs and puts a `TenantContext` on the request. No key gets the
anonymous tenant only when anonymous access is on for this caller: `--anonymous` for every
caller; by default (the proxy listening on loopback) for local callers only, that is a peer
on loopback whose request was not forwarded (no `Forwarded`, `X-Forwarded-For` or
`X-Real-IP` header: a reverse proxy on the same machine that sets one passes on a remote
client, which gets no anonymous access). Revoked keys get 401, and so do unknown keys once
a tenant exists; before that, for a caller with anonymous access, any key is the anonymous
tenant too (placeholder keys: clients and SDKs that insist on one, `api_key="EMPTY"`),
unless `--strict-keys`. Every anonymous
caller shares the anonymous tenant's anchors. Each tenant has its own secret salt in
the ledger, so its anchor keys live in its own namespace; a client `cache_salt` can only
narrow that further (`TenantContext.caller`). `/health`, `/metrics` and `/admin` are not
tenant routes (the admin API has its own token, proxy/admin.py).

The in-flight quota holds across the processes of one proxy (`--processes`): each counts its
own requests in memory, and with several, a tenant's that has a quota in the ledger too
(`Ledger.enter_flight`: one short immediate transaction checks the tenant's total and counts
the request), because a limit divided among processes would refuse a tenant whose requests
the kernel happened to hand to one process while the others sit idle. A tenant without a
quota (an admin removed it: every tenant gets the proxy's default at creation) costs no
ledger write per request.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from anchorcache.state.ledger import Ledger
from anchorcache.state.records import Quotas, Tenant

from .config import is_loopback
from .errors import ApiError
from .lifecycle import SHARED_TENANT, Caller
from .planner import tenant_namespace

ANONYMOUS = "anonymous"
TENANT_PREFIXES = ("/v1/",)
MAX_CACHE_SALT = 256
GET_A_KEY = ("an operator creates one with `anchorcache ops tenant-add NAME` (a tenant and "
             "its first key) or `anchorcache ops key-add TENANT`")


FORWARDED_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Real-IP")


def local_caller(request: web.Request) -> bool:
    """Whether the caller is on this machine: a loopback peer, not forwarding for another."""
    peer = request.remote
    return peer is not None and is_loopback(peer) and \
        not any(h in request.headers for h in FORWARDED_HEADERS)


def bearer(request: web.Request) -> str | None:
    """The bearer token of a request (also `x-api-key`, as Anthropic clients send it)."""
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None


@dataclass(frozen=True)
class TenantContext:
    tenant: Tenant

    def caller(self, cache_salt: str | None = None) -> Caller:
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt
                                       or len(cache_salt) > MAX_CACHE_SALT):
            raise ApiError("invalid_request", f"'cache_salt' must be a non-empty string of at "
                           f"most {MAX_CACHE_SALT} characters", param="cache_salt")
        ns = tenant_namespace(self.tenant.salt, self.tenant.name, cache_salt)
        return Caller(self.tenant.name, ns, own_namespace=cache_salt is None,
                      max_anchor_bytes=self.tenant.quotas.max_anchor_bytes)


TENANT = web.RequestKey("tenant", TenantContext)


class Tenants:
    """Resolves keys to tenants and counts requests in flight per tenant.

    `anonymous`: True for every caller, "local" for local callers only (`local_caller`),
    False for none. `placeholder_keys`: an unknown key is the anonymous tenant while no
    tenant exists (only for a caller with anonymous access)."""

    def __init__(self, ledger: Ledger, *, anonymous: bool | str, default_quotas: Quotas,
                 placeholder_keys: bool = False, across_processes: bool = False) -> None:
        """`across_processes`: this is one of several processes of a proxy; the in-flight
        quota is counted in the ledger, for all of them together."""
        if anonymous not in (True, False, "local"):
            raise ValueError(f"anonymous must be True, False or 'local', not {anonymous!r}")
        self.ledger = ledger
        self.anonymous = anonymous
        self.placeholder_keys = placeholder_keys
        self.default_quotas = default_quotas
        self.in_flight: Counter[str] = Counter()  # this process's
        self.across_processes = across_processes
        self._tenants_exist = False  # once true, stays true: tenants are never deleted

    def tenants_exist(self) -> bool:
        """Whether an operator created a tenant (the anonymous tenant and the holder of the
        shared toolsets' salt do not count). Read from the ledger until the first one shows
        up, so a tenant added by another proxy on the same ledger counts too."""
        if not self._tenants_exist:
            self._tenants_exist = any(t.name not in (ANONYMOUS, SHARED_TENANT)
                                      for t in self.ledger.tenants())
        return self._tenants_exist

    def _in_ledger(self, tenant: Tenant) -> bool:
        """Whether `tenant`'s requests are counted in the ledger: with several processes, for
        a tenant with a quota only (a tenant without one costs no write per request). The
        same `Tenant` record is passed to `enter` and `leave`, so both agree."""
        return self.across_processes and tenant.quotas.max_in_flight is not None

    def enter(self, tenant: Tenant) -> bool:
        """Count a request of `tenant` in flight, unless that would pass its quota (False)."""
        limit = tenant.quotas.max_in_flight
        if self._in_ledger(tenant):
            if not self.ledger.enter_flight(tenant.name, limit):
                return False
        elif limit is not None and self.in_flight[tenant.name] >= limit:
            return False
        self.in_flight[tenant.name] += 1
        return True

    def leave(self, tenant: Tenant) -> None:
        self.in_flight[tenant.name] -= 1
        if self.in_flight[tenant.name] <= 0:
            del self.in_flight[tenant.name]
        if self._in_ledger(tenant):
            self.ledger.leave_flight(tenant.name)

    def in_flight_now(self) -> dict[str, int]:
        """Requests in flight per tenant: this process's; with several, every process's for
        the tenants with a quota (counted in the ledger), this process's for the others."""
        if not self.across_processes:
            return dict(self.in_flight)
        return {**self.in_flight, **self.ledger.flights()}

    def resolve(self, api_key: str | None, *, local: bool = False) -> Tenant:
        """The tenant of `api_key`; `local`: whether the caller is on this machine."""
        anonymous = self.anonymous is True or (self.anonymous == "local" and local)
        if api_key is None:
            if not anonymous:
                where = "on this proxy" if self.anonymous is False else \
                    "for callers that are not on this machine"
                raise ApiError("unauthorized", "no API key: send 'Authorization: Bearer KEY' "
                               f"(anonymous access is off {where}); {GET_A_KEY}")
            return self.ledger.ensure_tenant(ANONYMOUS, self.default_quotas)
        key = self.ledger.lookup_key(api_key)
        if key is None:
            if anonymous and self.placeholder_keys and not self.tenants_exist():
                return self.ledger.ensure_tenant(ANONYMOUS, self.default_quotas)
            anonymous_hint = " (or send no key, to run as the anonymous tenant)" \
                if anonymous else ""
            raise ApiError("invalid_api_key",
                           f"incorrect API key provided: {GET_A_KEY}{anonymous_hint}")
        if key.revoked_at is not None:
            raise ApiError("invalid_api_key", "this API key has been revoked")
        tenant = self.ledger.tenant(key.tenant)
        if tenant is None:  # the tenant row is gone; the key cannot be honoured
            raise ApiError("invalid_api_key", "incorrect API key provided")
        return tenant


TENANTS = web.AppKey("tenants", Tenants)


@web.middleware
async def tenant_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    if not request.path.startswith(TENANT_PREFIXES) or request.method == "OPTIONS":
        return await handler(request)
    tenants = request.app[TENANTS]
    tenant = tenants.resolve(bearer(request), local=local_caller(request))
    if not tenants.enter(tenant):
        raise ApiError("rate_limit_exceeded", f"tenant {tenant.name!r} already has "
                       f"{tenant.quotas.max_in_flight} requests in flight (its quota); retry "
                       "when one finishes")
    request[TENANT] = TenantContext(tenant)
    try:
        return await handler(request)
    finally:
        tenants.leave(tenant)
