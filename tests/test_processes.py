"""`anchorcache proxy --processes 2`: one port, one ledger, one proxy as clients see it.

A real two-process proxy (a subprocess) in front of a real embedded worker, beside a
one-process proxy with anchors off (the reference outputs). Which process serves a request
is chosen by the kernel per connection (SO_REUSEPORT): `process_client(proxy, k)` opens
connections until one lands on process k (`X-Anchorcache-Process`) and keeps it. The
ledger's cross-process parts (change numbers, locks, the in-flight count) are checked on a
real SQLite file first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from anchorcache.cli import free_port, wait_ready
from anchorcache.proxy.tenants import Tenants
from anchorcache.state.ledger import Ledger
from anchorcache.state.records import AnchorStatus, NewAnchor, Quotas
from anchorcache.testing.servers import (
    ADMIN,
    PROCESS_HEADER,
    Server,
    process_client,
    proxy_process,
    worker_process,
)

SYSTEM = [{"role": "system", "content": "You are a terse assistant of the geography desk. "
                                        "Answer in one short sentence."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
QUESTIONS = ["What is the capital of France?", "And of Italy?", "And of Spain?",
             "And of Portugal?"]


# ---- the ledger, shared by processes ------------------------------------------------------

def test_the_ledger_tells_each_process_what_the_others_changed(tmp_path):
    one, two = Ledger.open(tmp_path), Ledger.open(tmp_path)  # two processes' connections
    for led in (one, two):
        led.number_anchor_changes()
    try:
        seen = two.anchor_seq()
        a = NewAnchor(b"k" * 16, 10, None, 3, 1024, "conversation")
        one.open_reservation("r1", "t", "w", "e1")
        one.record_written("r1", "w", "e1", b"n" * 16, "t", [a])
        one.commit("w", "e1", [a.key])
        seen, rows = two.anchor_changes(seen)
        assert [(r.key, r.status) for r in rows] == [(a.key, AnchorStatus.COMMITTED)]
        assert two.anchor_changes(seen) == (seen, [])  # nothing new: nothing read
        one.record_hits("w", "e1", [a.key])  # a hit changes nothing routing needs
        assert two.anchor_changes(seen) == (seen, [])
        one.mark("w", "e1", [a.key], AnchorStatus.EVICTED)
        seen, rows = two.anchor_changes(seen)
        assert [r.status for r in rows] == [AnchorStatus.EVICTED]
        one.housekeep(retention_s=0)  # the row is deleted: numbers are never handed out twice
        one.record_held("w", "e1", b"n" * 16, "t", [a])
        assert [r.status for r in two.anchor_changes(seen)[1]] == [AnchorStatus.COMMITTED]

        # a sibling's open reservation survives this one's reconcile while it lives
        two.owner = one.owner + 1
        two.open_reservation("r2", "t", "w", "e1")
        one.reconcile("w", "e1", [], alive=lambda pid: pid == two.owner)
        assert {r["rid"]: r["outcome"] for r in one.reservations()}["r2"] == "open"
        one.reconcile("w", "e1", [], alive=lambda pid: False)
        assert {r["rid"]: r["outcome"] for r in one.reservations()}["r2"] == "abandoned"
    finally:
        one.close()
        two.close()


def test_locks_and_the_in_flight_quota_hold_across_connections(tmp_path):
    one, two = Ledger.open(tmp_path), Ledger.open(tmp_path)
    two.owner = one.owner + 1
    try:
        assert one.try_lock("warm/x", "a", 60) and not two.try_lock("warm/x", "b", 60)
        one.unlock("warm/x", "a")
        assert two.try_lock("warm/x", "b", 0) and one.try_lock("warm/x", "a", 60)  # expired
        assert one.enter_flight("t", 2) and two.enter_flight("t", 2)
        assert not one.enter_flight("t", 2) and not two.enter_flight("t", 2)
        two.leave_flight("t")
        assert one.enter_flight("t", 2)
        assert two.enter_flight("t", 2) is False
        # a process that died with requests in flight: its count goes at the next start
        assert one.forget_flights(lambda pid: pid != two.owner) == 1  # and this one's own
        assert two.enter_flight("t", 1)
    finally:
        one.close()
        two.close()


def test_only_a_tenant_with_a_quota_costs_ledger_writes_per_request(tmp_path):
    """With several processes a tenant with an in-flight quota is counted in the ledger (all
    processes together), one without is counted in memory only: no write per request."""
    one, two = Ledger.open(tmp_path), Ledger.open(tmp_path)
    two.owner = one.owner + 1
    try:
        limited, _, _ = one.create_tenant("limited", Quotas(max_in_flight=1))
        free, _, _ = one.create_tenant("free")
        mine = Tenants(one, anonymous=False, default_quotas=Quotas(), across_processes=True)
        other = Tenants(two, anonymous=False, default_quotas=Quotas(), across_processes=True)
        assert mine.enter(free) and mine.enter(free) and other.enter(free)
        assert mine.enter(limited) and not other.enter(limited)  # 1 in all processes
        assert one.flights() == {"limited": 1}  # the free tenant wrote nothing
        assert mine.in_flight_now() == {"free": 2, "limited": 1}
        mine.leave(limited)
        assert other.enter(limited) and one.flights() == {"limited": 1}
        for tenants in (mine, mine, other):
            tenants.leave(free)
        other.leave(limited)
        assert one.flights() == {} and mine.in_flight_now() == {}
    finally:
        one.close()
        two.close()


# ---- a two-process proxy --------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(default_model_dir, tmp_path_factory) -> Iterator[tuple[Server, Server]]:
    """(the two-process proxy, a one-process proxy with anchors off), one worker; the
    two-process proxy's ledger is in `two.state_dir`."""
    state = tmp_path_factory.mktemp("state")
    with worker_process(model=str(default_model_dir)) as worker, \
            proxy_process(worker.url, "--processes", "2", state_dir=str(state)) as two, \
            proxy_process(worker.url, "--no-anchors") as off:
        two.state_dir = state
        yield two, off


def chat(client: httpx.Client, messages: list[dict], key: str | None = None) -> dict:
    resp = client.post("/v1/chat/completions", json={
        "model": "default", "messages": messages, "tools": TOOLS, "temperature": 0,
        "max_tokens": 8}, headers={"Authorization": f"Bearer {key}"} if key else {})
    assert resp.status_code == 200, resp.text
    return resp.json()


def metric(text: str, name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


def test_a_conversation_restores_whichever_process_serves_each_turn(stack):
    two, off = stack
    clients = [process_client(two, 0), process_client(two, 1)]
    messages = list(SYSTEM)
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        reply = chat(clients[turn % 2], messages)  # each turn on the other process
        reference = chat(httpx.Client(base_url=off.url, timeout=300), messages)
        assert reply["choices"][0]["message"] == reference["choices"][0]["message"]
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        if turn > 0:  # the last turn's anchors, written by the other process
            assert cached > 0, (turn, reply["usage"])
        messages.append({"role": "assistant",
                         "content": reply["choices"][0]["message"]["content"] or ""})
        if turn == 0:  # the other process knows what this one committed before it serves
            known = [c.get("/admin/workers", headers=ADMIN).json()["data"][0]["anchors"]
                     for c in clients]
            assert known[0] > 0 and known[1] == known[0]

    # one scrape, from either process, counts both processes' requests
    scrapes = [c.get("/metrics").text for c in clients]
    for text in scrapes:
        assert metric(text, "anchorcache_http_requests_total", route="/v1/chat/completions",
                      status="200") == len(QUESTIONS)
        assert metric(text, "anchorcache_anchor_lookups_total", result="restored") \
            == len(QUESTIONS) - 1
    for c in clients:
        c.close()


def test_a_pin_made_in_one_process_holds_in_the_other(stack):
    two, _ = stack
    first, second = process_client(two, 0), process_client(two, 1)
    made = first.post("/admin/tenants", json={"name": "pinner"}, headers=ADMIN)
    key = made.json()["api_key"]
    ts = first.post("/admin/tenants/pinner/toolsets", headers=ADMIN,
                    json={"messages": SYSTEM, "tools": TOOLS, "pin": True}).json()
    assert ts["pinned"]
    listed = second.get("/admin/toolsets", params={"tenant": "pinner"}, headers=ADMIN).json()
    (seen,) = listed["data"]
    assert seen["pinned"] and seen["warm_on"] == ["w0"]
    reply = chat(second, SYSTEM + [{"role": "user", "content": "Weather in Bern?"}],
                 key=key)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == ts["anchor"]["depth"]
    # live worker changes would hold in one process only: refused
    refused = second.post("/admin/workers", json={"url": "http://127.0.0.1:9"}, headers=ADMIN)
    assert refused.status_code == 409, refused.text
    first.close()
    second.close()


def test_a_tenant_never_restores_what_another_wrote_through_the_other_process(stack):
    """Each process follows the other's anchors through the ledger, namespaces and all:
    tenant A's prompt restores through either process for A, and for B and C (the same
    prompt, once each, one through each process) nothing."""
    two, _ = stack
    clients = [process_client(two, 0), process_client(two, 1)]
    a, b, c = (clients[0].post("/admin/tenants", json={"name": name}, headers=ADMIN)
               .json()["api_key"] for name in ("iso-a", "iso-b", "iso-c"))
    messages = SYSTEM + [{"role": "user", "content": "Is it raining in Oslo today?"}]
    first = chat(clients[0], messages, key=a)["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    again = chat(clients[1], messages, key=a)["usage"]  # A's anchors, written by process 0
    assert again["prompt_tokens_details"]["cached_tokens"] > 0
    for client, key in zip(clients, (b, c), strict=True):
        other = chat(client, messages, key=key)["usage"]
        assert other["prompt_tokens"] == first["prompt_tokens"]
        assert other["prompt_tokens_details"]["cached_tokens"] == 0, other
        assert other["timings"]["anchor_hits"] == [], other
    for client in clients:
        client.close()


def test_the_in_flight_quota_holds_across_processes(stack):
    two, _ = stack
    first, second = process_client(two, 0), process_client(two, 1)
    key = first.post("/admin/tenants", json={"name": "quota"}, headers=ADMIN).json()["api_key"]
    assert first.post("/admin/tenants/quota/quotas", json={"max_in_flight": 1},
                      headers=ADMIN).status_code == 200
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": "default", "temperature": 0, "max_tokens": 400, "stream": True,
            "messages": [{"role": "user", "content": "Count from 1 to 500, one per line."}]}
    with first.stream("POST", "/v1/chat/completions", json=body, headers=auth) as slow:
        assert slow.status_code == 200
        # in flight in process 0. The line iterator is kept: dropped, it closes the response,
        # the proxy sees its client gone and ends the request, and on a loaded machine that
        # came before the second request, which was then let in
        lines = slow.iter_lines()
        next(lines)
        refused = second.post("/v1/chat/completions", headers=auth,
                              json={**body, "stream": False, "max_tokens": 1})
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    first.close()  # the client went away: the request ends, its place comes back
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        again = second.post("/v1/chat/completions", headers=auth,
                            json={**body, "stream": False, "max_tokens": 1})
        if again.status_code == 200:
            break
        time.sleep(0.1)
    assert again.status_code == 200, again.text
    second.close()


def test_a_process_that_dies_is_replaced_and_warms_nothing_twice(stack):
    """After the pin test: the replacement loads the pinned toolset's anchor from the
    ledger instead of warming it again."""
    two, _ = stack
    warms = len(_warm_rids(two))
    victim = process_client(two, 1)
    pid = int(victim.get("/admin/stats", headers=ADMIN).json()["process"]["pid"])
    victim.close()
    os.kill(pid, signal.SIGKILL)
    for _ in range(600):
        kids = [p.pid for p in psutil.Process(two.proc.pid).children()]
        if pid not in kids and len(kids) == 2:
            try:
                client = process_client(two, 1)
            except (AssertionError, httpx.HTTPError):
                time.sleep(0.1)
                continue
            break
        time.sleep(0.1)
    else:
        raise AssertionError("process 1 was not replaced")
    assert int(client.get("/admin/stats", headers=ADMIN).json()["process"]["pid"]) != pid
    client.close()
    assert len(_warm_rids(two)) == warms


def _warm_rids(proxy: Server) -> list[str]:
    """The toolset warm-ups the proxy ran (its ledger's reservations)."""
    ledger = Ledger.open(proxy.state_dir)
    try:
        return [r["rid"] for r in ledger.reservations() if r["rid"].startswith("warm-")]
    finally:
        ledger.close()


def test_serve_runs_several_proxy_processes_and_stops_them_all(default_model_dir, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "anchorcache.cli", "serve", "--port", str(port),
                             "--processes", "2", "--threads", "2", "--log-level", "warning"],
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                 "ANCHORCACHE_STATE_DIR": str(tmp_path)},
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout_s=300)  # the first
        while "(2 processes)" not in proc.stdout.readline():  # and the second serve
            assert proc.poll() is None
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 3  # the worker and two proxy processes
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300, json={
            "model": "default", "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert reply.status_code == 200 and PROCESS_HEADER in reply.headers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _gone, alive = psutil.wait_procs(children, timeout=30)
        assert alive == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
