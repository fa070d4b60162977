"""`cache_control.ttl` kept (`proxy/leases.py`) on a real worker with little anchor memory
(a tiny Qwen3: 512 bytes of KV a token, 1 MiB: about 2,000 tokens of anchors) behind a real
proxy and ledger: a marked anchor outlives the memory pressure that evicts an unmarked one,
and is restored after it; once its lease expires (the lease clock moved, not slept) it is an
ordinary anchor again; a tenant leases no more than its budget, and its leases evict no one;
a toolset's pin and a lease on one anchor hold it until both are gone. Each test has a proxy
of its own (a fresh ledger) on the module's worker, and tenants of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from anchorcache.proxy.app import create_app
from anchorcache.proxy.config import ProxyConfig
from anchorcache.proxy.lifecycle import AnchorLifecycle
from anchorcache.proxy.running import STATE
from anchorcache.testing.metrics import parse
from anchorcache.testing.servers import ADMIN, ADMIN_TOKEN, Server, worker_process

pytestmark = pytest.mark.slow

ANCHOR_BYTES = 1 << 20  # the least a worker takes
WORDS = " ".join(f"word{i}" for i in range(150))  # about 400 tokens


@pytest.fixture(scope="module")
def small_worker(tiny_qwen3) -> Iterator[Server]:
    with worker_process("--anchor-slots", "64", "--anchor-bytes", str(ANCHOR_BYTES),
                        model=str(tiny_qwen3)) as w:
        yield w


class Proxy:
    """A proxy on `small_worker` (the aiohttp test client) and its worker's lease clock."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.offset_s = 0.0  # how far the lease clock is ahead of the real one
        self.lifecycle.leases.clock = lambda: time.monotonic() + self.offset_s

    @property
    def lifecycle(self) -> AnchorLifecycle:
        return self.client.server.app[STATE].targets.all[0].lifecycle

    async def admin(self, method: str, path: str, **kw: Any) -> Any:
        resp = await self.client.request(method, path, headers=ADMIN, **kw)
        assert resp.status == 200, await resp.text()
        return await resp.json()

    async def tenant(self, name: str, **quotas: int) -> str:
        key = (await self.admin("POST", "/admin/tenants", json={"name": name}))["api_key"]
        if quotas:
            await self.admin("POST", f"/admin/tenants/{name}/quotas", json=quotas)
        return key

    async def ask(self, key: str, system: str, messages: list[dict[str, Any]]) -> dict[str, int]:
        """A greedy one-token `/v1/messages` request; its usage."""
        resp = await self.client.post("/v1/messages", headers={"x-api-key": key}, json={
            "model": "default", "max_tokens": 1, "temperature": 0, "system": system,
            "messages": messages})
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        assert set(body["usage"]) == {"input_tokens", "output_tokens",
                                      "cache_creation_input_tokens", "cache_read_input_tokens"}
        return body["usage"]

    async def pinned(self, tenant: str) -> dict[str, int]:
        """The tenant's pinned anchors on the worker: key → depth."""
        slots = (await self.admin("GET", "/admin/slots"))["data"]
        return {s["key"]: s["depth"] for s in slots if s["pinned"] and s["tenant"] == tenant}

    async def leases(self) -> dict[tuple[str, str], float]:
        """`anchorcache_anchor_leases_total` by (tenant, outcome)."""
        resp = await self.client.get("/metrics")
        samples = parse(await resp.text())
        return {(dict(labels)["tenant"], dict(labels)["outcome"]): v
                for (name, labels), v in samples.items()
                if name == "anchorcache_anchor_leases_total"}


@pytest.fixture()
async def make_proxy(aiohttp_client, small_worker, tmp_path):
    async def make(**config: Any) -> Proxy:
        app = create_app(ProxyConfig(worker_urls=(small_worker.url,), state_dir=str(tmp_path),
                                     admin_token=ADMIN_TOKEN, **config))
        return Proxy(await aiohttp_client(app))
    return make


def marked(text: str, ttl: str | None = "1h", *, mark: bool = True) -> list[dict[str, Any]]:
    """A first user message whose block carries a cache_control mark (`ttl` None: without
    one; `mark` False: unmarked), and the rest of the turn; the mark asks for an anchor at
    the end of that message."""
    cc = {"cache_control": {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}} if mark else {}
    return [{"role": "user", "content": [{"type": "text", "text": text, **cc}]},
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "Summarize it."}]


def follow_up(first: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same first message (unmarked), then another turn: it shares the prompt up to the
    end of the first message only."""
    return [{"role": "user", "content": first[0]["content"][0]["text"]},
            {"role": "assistant", "content": "Understood."},
            {"role": "user", "content": "What was the first word?"}]


async def pressure(proxy: Proxy, key: str, tag: str, n: int = 8) -> None:
    """`n` new conversations: several times what the worker's anchor memory holds."""
    for i in range(n):
        await proxy.ask(key, f"Pressure {tag} {i}.",
                        [{"role": "user", "content": f"{tag} {i}: {WORDS}"}])


@pytest.mark.parametrize("share", [1.0, 0.5], ids=["worker-lru", "tenant-quota"])
async def test_a_marked_anchor_survives_pressure_that_evicts_an_unmarked_one(make_proxy, share):
    """A conversation whose first message is marked, then another whose first message is
    the whole prompt, unmarked: both end in an anchor of the same size at the same depth.
    Then pressure from the same tenant: the worker's LRU (share 1: no byte quota) or the
    tenant's byte quota (half the worker) evicts the newer, unmarked anchor and keeps the
    marked one, which the next request restores exactly up to the marked message."""
    proxy = await make_proxy(tenant_anchor_share=share)
    key = await proxy.tenant("t")
    first = await proxy.ask(key, "You are assistant A.", marked(f"A: {WORDS}"))
    assert first["cache_read_input_tokens"] == 0
    [(leased, depth)] = (await proxy.pinned("t")).items()
    other = [{"role": "user", "content": f"B: {WORDS}"}]
    await proxy.ask(key, "You are assistant B.", other)
    rows = await proxy.admin("GET", "/admin/anchors", params={"tenant": "t"})
    same = {r["key"]: r["nbytes"] for r in rows["data"] if r["depth"] == depth}
    assert len(same) == 2 and len(set(same.values())) == 1, same  # the marked one, and B's
    [unmarked] = set(same) - {leased}
    await pressure(proxy, key, "p")
    again = await proxy.ask(key, "You are assistant A.", follow_up(marked(f"A: {WORDS}")))
    assert again["cache_read_input_tokens"] == depth
    assert await proxy.pinned("t") == {leased: depth}
    evicted = await proxy.admin("GET", "/admin/anchors", params={"tenant": "t",
                                                                 "status": "evicted"})
    assert unmarked in {r["key"] for r in evicted["data"]}
    assert (await proxy.ask(key, "You are assistant B.", [
        *other, {"role": "assistant", "content": "Understood."},
        {"role": "user", "content": "Go on."}]))["cache_read_input_tokens"] < depth
    assert (await proxy.leases())[("t", "granted")] == 1


async def until_unpinned(proxy: Proxy, tenant: str, timeout_s: float = 10.0) -> None:
    """Wait for the background sweep (every second) to unpin the tenant's anchors."""
    deadline = time.monotonic() + timeout_s
    while await proxy.pinned(tenant):
        assert time.monotonic() < deadline, "the expired lease was not released"
        await asyncio.sleep(0.2)


async def test_a_lease_runs_from_the_last_use_and_then_its_bytes_and_anchor_are_free(make_proxy):
    """A 5-minute mark (no ttl) is kept 5 minutes after the last request that used it: a
    restore 200 s in starts it over. Meanwhile the global lease budget (one conversation's
    chain) refuses another tenant's lease, its request served as usual; once the lease
    expired the sweep unpins the anchor, the other tenant's next mark gets the budget, and
    pressure evicts the anchor like any other."""
    proxy = await make_proxy(tenant_anchor_share=1.0, lease_budget_bytes=400_000)
    key, other = await proxy.tenant("t"), await proxy.tenant("u")
    await proxy.ask(key, "You are assistant A.", marked(f"A: {WORDS}", ttl=None))
    [(leased, depth)] = (await proxy.pinned("t")).items()
    refused = await proxy.ask(other, "You are assistant U.", marked(f"U: {WORDS}"))
    assert refused["cache_creation_input_tokens"] > 0  # anchored all the same, not leased
    assert await proxy.pinned("u") == {}
    proxy.offset_s = 200
    used = await proxy.ask(key, "You are assistant A.", follow_up(marked(f"A: {WORDS}")))
    assert used["cache_read_input_tokens"] == depth
    proxy.offset_s = 450  # 250 s after the use
    await proxy.lifecycle.expire_leases()
    assert await proxy.pinned("t") == {leased: depth}
    proxy.offset_s = 501
    await until_unpinned(proxy, "t")
    assert (await proxy.ask(other, "You are assistant U.", marked(f"U: {WORDS}"))
            )["cache_read_input_tokens"] > 0
    assert len(await proxy.pinned("u")) == 1
    await pressure(proxy, key, "p")
    assert (await proxy.ask(key, "You are assistant A.", follow_up(marked(f"A: {WORDS}")))
            )["cache_read_input_tokens"] < depth
    counts = await proxy.leases()
    assert (counts[("t", "granted")], counts[("t", "expired")]) == (1, 1)
    assert (counts[("u", "refused")], counts[("u", "granted")]) == (1, 1)


async def test_a_tenant_leases_within_its_quota_and_evicts_no_one(make_proxy):
    """A tenant whose byte quota holds one conversation's chain marks every request for an
    hour: its first lease is granted, the others refused (each request served as usual), and
    a quiet tenant's anchor survives all of that tenant's traffic; unbounded, its leases
    would have pinned the whole worker."""
    proxy = await make_proxy()
    quiet = await proxy.tenant("quiet")
    greedy = await proxy.tenant("greedy", max_anchor_bytes=400_000)
    short = [{"role": "user", "content": f"Q: {WORDS[:300]}"}]
    await proxy.ask(quiet, "You are the quiet assistant.", short)
    for i in range(7):
        await proxy.ask(greedy, f"You are greedy assistant {i}.", marked(f"G{i}: {WORDS}"))
    assert len(await proxy.pinned("greedy")) == 1
    workers = (await proxy.admin("GET", "/admin/workers"))["data"]
    assert 0 < workers[0]["leased_bytes"] <= 400_000
    counts = await proxy.leases()
    assert (counts[("greedy", "granted")], counts[("greedy", "refused")]) == (1, 6)
    again = await proxy.ask(quiet, "You are the quiet assistant.", [
        *short, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}])
    assert again["cache_read_input_tokens"] > 100  # the quiet tenant's anchor survived


async def test_a_toolset_pin_and_a_lease_on_one_anchor_hold_it_until_both_are_gone(
        make_proxy, small_worker):
    """A marked system prompt leases the instruction anchor, which is also the tenant's
    toolset: the lease expiring leaves the pinned toolset pinned, unpinning the toolset
    leaves the leased anchor pinned, and it is unpinned when both are gone. A proxy that
    stops releases its leases; one that crashed left pins that the next proxy on its ledger
    releases at start."""
    proxy = await make_proxy()
    key = await proxy.tenant("ts")
    system = [{"type": "text", "text": "You are the toolset assistant.",
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    hello = [{"role": "user", "content": "Hello."}]

    async def ask() -> None:
        resp = await proxy.client.post("/v1/messages", headers={"x-api-key": key}, json={
            "model": "default", "max_tokens": 1, "system": system, "messages": hello})
        assert resp.status == 200, await resp.text()

    await ask()
    [(instruction, _)] = (await proxy.pinned("ts")).items()
    [toolset] = (await proxy.admin("GET", "/admin/toolsets", params={"tenant": "ts"}))["data"]
    assert toolset["toolset"] == instruction and not toolset["pinned"]
    await proxy.admin("POST", "/admin/pin", json={"toolset": instruction})
    proxy.offset_s = 3601
    await proxy.lifecycle.expire_leases()
    assert instruction in await proxy.pinned("ts")  # the toolset's pin stays
    await ask()  # leased again
    await proxy.admin("POST", "/admin/unpin", json={"toolset": instruction})
    assert instruction in await proxy.pinned("ts")  # the lease's pin stays
    proxy.offset_s = 2 * 3601
    await proxy.lifecycle.expire_leases()
    assert await proxy.pinned("ts") == {}

    await ask()  # leased; then the proxy stops: its leases go with it
    assert await proxy.pinned("ts")
    await proxy.client.close()
    async with aiohttp.ClientSession() as worker:
        async def pinned() -> set[str]:
            async with worker.get(small_worker.url + "/anchor/slots") as resp:
                return {s["key"] for s in (await resp.json())["slots"] if s["pinned"]}

        assert instruction not in await pinned()
        # a crashed proxy's lease: pinned on the worker, unknown to the next proxy
        async with worker.post(small_worker.url + "/anchor/pin", json={"key": instruction}) as r:
            assert (await r.json())["pinned"]
        await make_proxy()
        assert instruction not in await pinned()
