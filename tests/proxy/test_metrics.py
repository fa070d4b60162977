"""`/metrics`: the app's own registry, parsed with prometheus-client's parser.

The end-to-end tests replay a known set of requests through a real proxy and worker (the
default model) and check that every counter moved by exactly what the replies reported.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from aiohttp import web
from prometheus_client import generate_latest

from anchorcache.proxy.anchor_index import AnchorRecord
from anchorcache.proxy.metrics import OTHER, ProxyMetrics, TenantLabels
from anchorcache.proxy.planner import Plan
from anchorcache.proxy.tenants import ANONYMOUS as DEFAULT_TENANT
from anchorcache.testing.data import conversations, turn_requests
from anchorcache.testing.inprocess import proxy_in_process
from anchorcache.testing.metrics import delta, parse, scrape, total, value
from anchorcache.testing.servers import ADMIN_TOKEN, Endpoint, Server
from anchorcache.wire import AnchorKind, AnchorPlan, GenerateMeta

CHAT = "/v1/chat/completions"

# ---- bookkeeping, no server ---------------------------------------------------------------
def test_tenant_labels_are_bounded_and_stable():
    labels = TenantLabels(max_tenants=2)
    assert [labels(t) for t in ("a", "b", "c", "a", "d", "b")] == ["a", "b", OTHER, "a", OTHER, "b"]


def _record(key: bytes, depth: int, kind: AnchorKind, parent: bytes | None, nbytes: int) -> AnchorRecord:
    return AnchorRecord(namespace=b"ns", key=key, depth=depth, parent=parent, kind=kind, slot=0,
                        nbytes=nbytes, epoch="e")


def test_a_generation_is_recorded_from_plan_and_meta():
    m = ProxyMetrics(max_tenants=1)
    k1, k2, k3 = (bytes([i]) * 16 for i in (1, 2, 3))
    chain = (_record(k1, 10, AnchorKind.INSTRUCTION, None, 1000),
             _record(k2, 30, AnchorKind.CONVERSATION, k1, 2000),
             _record(k3, 50, AnchorKind.CONVERSATION, k2, 3000))
    plan = Plan(b"ns", AnchorPlan(namespace=b"ns"), chain)
    meta = {"epoch": "e", "finish_reason": {"type": "stop"}, "prompt_tokens": 60, "completion_tokens": 4, "cached_tokens": 30, "prefill_tokens": 30,
            "restore_ms": 2.0, "prefill_ms": 40.0, "decode_ms": 5.0, "snapshot_ms": 3.0,
            "anchors": {"restored": [{"key": k1.hex(), "depth": 10, "kind": "instruction"},
                                     {"key": k2.hex(), "depth": 30, "kind": "conversation"}],
                        "restore_miss": [{"key": k3.hex(), "depth": 50, "reason": "not_resident"}],
                        "written": [{"slot": 5, "key": "ab" * 16, "depth": 59, "parent": k2.hex(),
                                     "nbytes": 777, "kind": "conversation"}]}}
    m.record_ttft("acme", 0.05)
    m.record_generation("acme", plan, GenerateMeta.from_json(meta))
    m.record_generation("someone-else", Plan(b"", None), GenerateMeta.from_json(
        {"epoch": "e", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 8,
         "prefill_tokens": 8, "completion_tokens": 1, "cached_tokens": 0, "restore_ms": 0.0,
         "prefill_ms": 9.0, "decode_ms": 1.0, "anchors": {}}))
    m.record_reservations("acme", "aborted", "cancelled")
    s = parse(generate_latest(m.registry).decode())
    assert value(s, "anchorcache_anchor_hits_total", tenant="acme", kind="instruction") == 1
    assert value(s, "anchorcache_anchor_hits_total", tenant="acme", kind="conversation") == 1
    assert value(s, "anchorcache_anchor_misses_total", tenant="acme", kind="conversation",
                 reason="not_resident") == 1
    assert value(s, "anchorcache_anchor_lookups_total", tenant="acme", result="restored") == 1
    assert value(s, "anchorcache_restore_bytes_total", tenant="acme") == 3000
    assert value(s, "anchorcache_snapshot_bytes_total", tenant="acme", kind="conversation") == 777
    assert value(s, "anchorcache_snapshots_total", tenant="acme", kind="conversation") == 1
    assert value(s, "anchorcache_prompt_tokens_total", tenant="acme", source="restored") == 30
    assert value(s, "anchorcache_prompt_tokens_total", tenant="acme", source="prefilled") == 30
    # the second tenant is past the cap; anchors off: tokens counted, no anchor series
    assert value(s, "anchorcache_prompt_tokens_total", tenant=OTHER, source="prefilled") == 8
    assert total(s, "anchorcache_anchor_lookups_total", tenant=OTHER) == 0
    assert value(s, "anchorcache_ttft_seconds_count", tenant="acme") == 1
    assert value(s, "anchorcache_ttft_seconds_count", tenant=OTHER) == 0
    assert value(s, "anchorcache_snapshot_seconds_sum", tenant="acme") == pytest.approx(0.003)
    assert value(s, "anchorcache_reservations_total", tenant="acme", outcome="aborted",
                 reason="cancelled") == 1


def _closed_port_url() -> str:
    from anchorcache.cli import free_port

    return f"http://127.0.0.1:{free_port()}"


async def test_a_dead_or_hung_worker_costs_one_gauge(aiohttp_server):
    import aiohttp

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(60)
        return web.json_response({})

    hung_app = web.Application()
    hung_app.router.add_get("/anchor/stats", hang)
    hung = await aiohttp_server(hung_app)
    m = ProxyMetrics(worker_timeout_s=0.2)
    async with aiohttp.ClientSession() as session:
        for url in (_closed_port_url(), str(hung.make_url(""))):
            await m.worker.refresh(session, [View("w0", url)], m.worker_timeout_s)
            s = parse(generate_latest(m.registry).decode())
            assert value(s, "anchorcache_worker_up", worker="w0") == 0
            assert not [k for k in s if k[0].startswith("anchorcache_worker_hits")]


@dataclass
class View:
    name: str
    id: str
    serving: bool = True
    load: int = 0
    routed: int = 0


# ---- a real proxy and worker --------------------------------------------------------------
@pytest.fixture(scope="module")
def metered(worker: Server) -> Iterator[Endpoint]:
    with proxy_in_process(worker.url) as server:  # its own ledger: tenants of its own
        yield server


def chat(proxy: Endpoint, messages, tools) -> dict:
    body = {"model": "default", "messages": messages, "tools": tools, "temperature": 0,
            "max_tokens": 4}
    resp = httpx.post(proxy.url + CHAT, json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


def short_conversations(n: int) -> list[dict]:
    return sorted(conversations("base"), key=lambda c: len(str(c)))[:n]


@pytest.mark.slow
def test_counters_move_by_the_exact_amounts_of_a_replay(metered: Endpoint, worker: Server):
    before = scrape(metered)
    usages = [chat(metered, messages, conv["tools"])["usage"]
              for conv in short_conversations(2) for messages in turn_requests(conv, 2)]
    after = scrape(metered)
    d = delta(after, before)
    worker_stats = httpx.get(worker.url + "/anchor/stats", timeout=30).json()

    n = len(usages)
    assert n == 4
    assert value(d, "anchorcache_http_requests_total", method="POST", route=CHAT, status="200") == n
    restored = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    prefilled = sum(u["timings"]["prefill_tokens"] for u in usages)
    assert restored > 0  # the second turns restored their history
    assert prefilled + restored == sum(u["prompt_tokens"] for u in usages)
    assert value(d, "anchorcache_prompt_tokens_total", tenant=DEFAULT_TENANT, source="restored") == restored
    assert value(d, "anchorcache_prompt_tokens_total", tenant=DEFAULT_TENANT, source="prefilled") == prefilled
    assert value(d, "anchorcache_completion_tokens_total", tenant=DEFAULT_TENANT) == \
        sum(u["completion_tokens"] for u in usages)
    kinds = collections.Counter(h["kind"] for u in usages for h in u["timings"]["anchor_hits"])
    for kind in ("instruction", "conversation", "response"):
        assert value(d, "anchorcache_anchor_hits_total", tenant=DEFAULT_TENANT, kind=kind) == kinds[kind]
    assert total(d, "anchorcache_anchor_misses_total") == 0
    assert value(d, "anchorcache_anchor_lookups_total", tenant=DEFAULT_TENANT, result="restored") == \
        sum(1 for u in usages if u["prompt_tokens_details"]["cached_tokens"] > 0)
    assert total(d, "anchorcache_anchor_lookups_total", tenant=DEFAULT_TENANT) == n
    for hist in ("anchorcache_ttft_seconds", "anchorcache_prefill_seconds"):
        assert value(d, hist + "_count", tenant=DEFAULT_TENANT) == n
    assert value(d, "anchorcache_restore_seconds_count", tenant=DEFAULT_TENANT) == \
        value(d, "anchorcache_anchor_lookups_total", tenant=DEFAULT_TENANT, result="restored")
    assert value(d, "anchorcache_restore_bytes_total", tenant=DEFAULT_TENANT) > 0
    # every snapshot was confirmed: what the proxy counted written, the worker counted confirmed
    written = total(d, "anchorcache_snapshots_total", tenant=DEFAULT_TENANT)
    assert written > 0
    assert value(d, "anchorcache_worker_confirms_total", worker="w0") == written
    assert value(d, "anchorcache_reservations_total", tenant=DEFAULT_TENANT, outcome="confirmed",
                 reason="ok") == n
    assert total(d, "anchorcache_reservations_total", outcome="aborted") == 0
    # the worker's own counters, as they were at the scrape
    assert value(after, "anchorcache_worker_up", worker="w0") == 1
    for name in ("hits", "misses", "confirms", "aborts"):
        assert value(after, f"anchorcache_worker_{name}_total", worker="w0") == worker_stats[name]
    assert value(after, "anchorcache_worker_bytes_used", worker="w0") == worker_stats["bytes_used"]


@pytest.mark.slow
def test_a_miss_is_counted_with_its_kind_and_reason(metered: Endpoint, worker: Server):
    conv = short_conversations(2)[1]
    messages = turn_requests(conv, 2)[-1]
    chat(metered, messages, conv["tools"])  # its anchors committed (if no earlier test did)
    primed = chat(metered, messages, conv["tools"])["usage"]["timings"]["anchor_hits"]
    assert primed  # its history came from anchors: the chain the next request will plan
    # evict this tenant's anchors on the worker, behind the proxy's back: the proxy still
    # plans the chain, the worker no longer holds it
    rows = httpx.get(metered.url + "/admin/anchors", params={"tenant": DEFAULT_TENANT},
                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30).json()["data"]
    assert {h["depth"] for h in primed} <= {r["depth"] for r in rows}
    for r in rows:
        httpx.post(worker.url + "/anchor/evict", json={"key": r["key"]}, timeout=30).raise_for_status()

    before = scrape(metered)
    usage = chat(metered, messages, conv["tools"])["usage"]
    d = delta(scrape(metered), before)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    # the planner named its chain's leaf; the worker missed there and restored nothing
    assert total(d, "anchorcache_anchor_misses_total") == 1
    assert value(d, "anchorcache_anchor_misses_total", tenant=DEFAULT_TENANT,
                 kind=primed[-1]["kind"], reason="not_resident") == 1
    assert value(d, "anchorcache_anchor_lookups_total", tenant=DEFAULT_TENANT, result="missed") == 1
    assert total(d, "anchorcache_anchor_hits_total") == 0
    assert value(d, "anchorcache_prompt_tokens_total", tenant=DEFAULT_TENANT, source="prefilled") == \
        usage["prompt_tokens"]


@pytest.mark.slow
def test_errors_and_unknown_routes_are_counted_by_status(metered: Endpoint):
    before = scrape(metered)
    assert httpx.get(metered.url + "/no/such/route", timeout=30).status_code == 404
    assert httpx.post(metered.url + CHAT, content=b"{not json", timeout=30).status_code == 400
    bad_header = httpx.post(metered.url + CHAT, headers={"X-Anchorcache-Anchors": "maybe"},
                            json={"model": "default", "messages": [{"role": "user", "content": "hi"}]},
                            timeout=30)
    assert bad_header.status_code == 400
    assert "X-Anchorcache-Anchors" in bad_header.json()["error"]["message"]
    d = delta(scrape(metered), before)
    assert value(d, "anchorcache_http_requests_total", method="GET", route="unmatched",
                 status="404") == 1
    assert value(d, "anchorcache_http_requests_total", method="POST", route=CHAT, status="400") == 2
    assert value(d, "anchorcache_http_requests_total", method="GET", route="/metrics",
                 status="200") == 1
    assert total(d, "anchorcache_prompt_tokens_total") == 0


@pytest.mark.slow
@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_failed_request_aborts_its_reservation_with_the_reason(metered: Endpoint, worker: Server,
                                                                where: str):
    """Counted whether the worker fails before its first event reaches the proxy (prefill;
    a decode failure may arrive with the first token, in one read) or after."""
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Name a colour."}]
    before = scrape(metered)
    httpx.post(worker.url + "/debug/fault", json={"where": where}, timeout=30).raise_for_status()
    failed = httpx.post(metered.url + CHAT, timeout=120,
                        json={"model": "default", "messages": messages, "max_tokens": 8})
    assert failed.status_code == 502
    ok = httpx.post(metered.url + CHAT, timeout=120, headers={"X-Anchorcache-Anchors": "off"},
                    json={"model": "default", "messages": messages, "max_tokens": 2})
    assert ok.status_code == 200
    d = delta(scrape(metered), before)
    assert value(d, "anchorcache_reservations_total", tenant=DEFAULT_TENANT, outcome="aborted",
                 reason="worker_error") == 1
    # the anchors-off request reserved nothing and planned no lookup; its tokens still count
    assert total(d, "anchorcache_reservations_total") == 1
    assert total(d, "anchorcache_anchor_lookups_total") == 0
    assert value(d, "anchorcache_prompt_tokens_total", tenant=DEFAULT_TENANT, source="prefilled") == \
        ok.json()["usage"]["prompt_tokens"]
    assert value(d, "anchorcache_http_requests_total", method="POST", route=CHAT, status="502") == 1


@pytest.mark.slow
def test_anchors_the_worker_failed_to_confirm_in_band_are_confirmed_by_the_proxy(
        metered: Endpoint, worker: Server):
    """The proxy asks the worker to confirm a request's anchors as it ends; when that fails
    (the reply's `confirmed` is null), the proxy confirms them itself: the reservation
    closes confirmed, and the next turn restores them."""
    messages = [{"role": "system", "content": "You answer briefly. " * 40},
                {"role": "user", "content": "Name a colour that starts with " + "qz"}]
    before = scrape(metered)
    httpx.post(worker.url + "/debug/fault", json={"where": "confirm"}, timeout=30).raise_for_status()
    first = httpx.post(metered.url + CHAT, timeout=120, json={
        "model": "default", "messages": messages, "max_tokens": 3, "temperature": 0})
    assert first.status_code == 200, first.text
    d = delta(scrape(metered), before)
    written = total(d, "anchorcache_snapshots_total", tenant=DEFAULT_TENANT)
    assert written > 0
    assert value(d, "anchorcache_worker_confirms_total", worker="w0") == written
    assert value(d, "anchorcache_reservations_total", tenant=DEFAULT_TENANT, outcome="confirmed",
                 reason="ok") == 1
    again = httpx.post(metered.url + CHAT, timeout=120, json={
        "model": "default", "messages": messages, "max_tokens": 3, "temperature": 0})
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again.json()["choices"] == first.json()["choices"]


@pytest.mark.slow
def test_the_anthropic_route_feeds_the_same_metrics(metered: Endpoint):
    before = scrape(metered)
    resp = httpx.post(metered.url + "/v1/messages", timeout=120,
                      headers={"anthropic-version": "2023-06-01"},
                      json={"model": "default", "max_tokens": 3, "temperature": 0,
                            "messages": [{"role": "user", "content": "Name a fruit."}]})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    d = delta(scrape(metered), before)
    assert value(d, "anchorcache_http_requests_total", method="POST", route="/v1/messages",
                 status="200") == 1
    assert value(d, "anchorcache_ttft_seconds_count", tenant=DEFAULT_TENANT) == 1
    assert value(d, "anchorcache_completion_tokens_total", tenant=DEFAULT_TENANT) == \
        usage["output_tokens"]
    assert total(d, "anchorcache_prompt_tokens_total", tenant=DEFAULT_TENANT) == \
        usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"]
    assert value(d, "anchorcache_reservations_total", tenant=DEFAULT_TENANT, outcome="confirmed",
                 reason="ok") == 1


@pytest.mark.slow
def test_completion_tokens_count_every_choice_of_n(metered: Endpoint):
    before = scrape(metered)
    resp = httpx.post(metered.url + CHAT, timeout=300, json={
        "model": "default", "n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 6,
        "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}]})
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    assert len(reply["choices"]) == 3
    completion_tokens = reply["usage"]["completion_tokens"]
    assert completion_tokens > 6  # more than one choice can write: the usage counts them all
    d = delta(scrape(metered), before)
    assert value(d, "anchorcache_completion_tokens_total", tenant=DEFAULT_TENANT) == completion_tokens
