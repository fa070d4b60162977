"""Tenants, keys and the admin API against a real worker and proxy: auth errors, isolation,
shared toolsets, one instruction anchor for a burst of one new toolset, pinning."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from anchorcache.testing.inprocess import proxy_in_process
from anchorcache.testing.servers import ADMIN, Endpoint, worker_process

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def system(tag: str) -> list[dict]:
    return [{"role": "system", "content": f"You are the {tag} assistant. Answer briefly."}]


def admin(proxy: Endpoint, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, proxy.url + path, headers=ADMIN, timeout=300, **kw)


def tenant(proxy: Endpoint, name: str) -> str:
    resp = admin(proxy, "POST", "/admin/tenants", json={"name": name})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["name"] == name and body["api_key"].startswith("ac-")
    return body["api_key"]


def chat(proxy: Endpoint, key: str | None, messages, tools=TOOLS, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "default", "messages": messages, "tools": tools, "temperature": 0,
            "max_tokens": 4, **kw}
    return httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=300)


def cached(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def closed(worker) -> Iterator[Endpoint]:
    """A proxy with anonymous access off."""
    with proxy_in_process(worker.url, anonymous=False) as server:
        yield server


def test_auth_errors_are_openai_shaped(closed):
    client = openai.OpenAI(base_url=closed.url + "/v1", api_key="ac-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        client.chat.completions.create(model="default", messages=user("hi"), max_tokens=1)
    assert err.value.status_code == 401
    assert err.value.body["code"] == "invalid_api_key"

    missing = chat(closed, None, user("hi"))
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    assert "no API key" in missing.json()["error"]["message"]

    key = tenant(closed, "auth-a")
    assert chat(closed, key, user("hi")).status_code == 200
    key_id = admin(closed, "GET", "/admin/tenants").json()["data"][-1]["keys"][0]["key_id"]
    second = admin(closed, "POST", "/admin/tenants/auth-a/keys").json()
    assert chat(closed, second["api_key"], user("hi")).status_code == 200
    revoked = admin(closed, "DELETE", f"/admin/tenants/auth-a/keys/{key_id}")
    assert revoked.json() == {"key_id": key_id, "revoked": True}
    gone = chat(closed, key, user("hi"))
    assert gone.status_code == 401 and "revoked" in gone.json()["error"]["message"]
    assert chat(closed, second["api_key"], user("hi")).status_code == 200  # the other key lives

    # the admin API: a tenant key is forbidden, a wrong or missing token unauthorized
    as_tenant = httpx.get(closed.url + "/admin/anchors", timeout=30,
                          headers={"Authorization": f"Bearer {second['api_key']}"})
    assert as_tenant.status_code == 403
    assert as_tenant.json()["error"]["code"] == "permission_denied"
    wrong = httpx.get(closed.url + "/admin/stats", headers={"Authorization": "Bearer x" * 3}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(closed.url + "/admin/stats", timeout=30).status_code == 401
    assert admin(closed, "POST", "/admin/tenants", json={"name": "auth-a"}).status_code == 409
    assert admin(closed, "POST", "/admin/tenants", json={"name": "../x"}).status_code == 400
    assert admin(closed, "DELETE", "/admin/tenants/auth-a/keys/key_nope").status_code == 404


def test_tenants_never_share_unless_a_toolset_is_shared(closed):
    a, b = tenant(closed, "iso-a"), tenant(closed, "iso-b")
    prompt = system("isolation") + user("What is the weather in Paris?")
    chat(closed, a, prompt)
    assert cached(chat(closed, a, prompt + [{"role": "assistant", "content": "Sunny."}]
                       + user("And in Rome?"))) > 0
    assert cached(chat(closed, b, prompt)) == 0  # exactly A's prompt
    # the same prompts gave each tenant its own anchors (keys in its own namespace)
    rows = {t: admin(closed, "GET", "/admin/anchors", params={"tenant": t}).json()["data"]
            for t in ("iso-a", "iso-b")}
    assert rows["iso-a"] and rows["iso-b"]
    assert {r["tenant"] for r in rows["iso-a"]} == {"iso-a"}
    assert not {r["key"] for r in rows["iso-a"]} & {r["key"] for r in rows["iso-b"]}
    # a cache_salt narrows sharing inside a tenant
    assert cached(chat(closed, a, prompt, cache_salt="narrow")) == 0

    # an admin shares a toolset of A: B's requests with it restore its instruction anchor
    made = admin(closed, "POST", "/admin/tenants/iso-a/toolsets",
                 json={"messages": system("shared"), "tools": TOOLS, "shared": True})
    assert made.status_code == 200, made.text
    ts = made.json()
    assert ts["shared"] and ts["anchor"]["depth"] > 0 and not ts["pinned"]
    hit = chat(closed, b, system("shared") + user("Weather in Oslo?"))
    assert cached(hit) == ts["anchor"]["depth"]
    assert hit.json()["usage"]["timings"]["anchor_hits"][0]["kind"] == "instruction"
    # ... and only that: a third tenant's private toolset stays private
    c = tenant(closed, "iso-c")
    chat(closed, c, system("private") + user("Weather in Lima?"))
    assert cached(chat(closed, b, system("private") + user("Weather in Lima?"))) == 0

    # unshared (pinned first, so the shared copy is pinned on the worker): the shared copy
    # is gone from the worker, and B's next request with that toolset restores nothing
    assert admin(closed, "POST", "/admin/pin", json={"toolset": ts["toolset"]}).status_code == 200
    off = admin(closed, "POST", "/admin/share", json={"toolset": ts["toolset"], "shared": False})
    assert off.status_code == 200 and off.json()["shared"] is False and off.json()["pinned"]
    shared_rows = admin(closed, "GET", "/admin/anchors", params={"tenant": "@shared"}).json()
    assert ts["anchor"]["depth"] not in {r["depth"] for r in shared_rows["data"]}
    slots = admin(closed, "GET", "/admin/slots").json()["data"]
    assert not [s for s in slots if s["tenant"] == "@shared"]
    assert [s["pinned"] for s in slots if s["key"] == ts["toolset"]] == [True]  # A's own stays
    again = chat(closed, b, system("shared") + user("Weather in Kyiv?"))
    assert cached(again) == 0 and again.json()["usage"]["timings"]["anchor_hits"] == []


def test_a_burst_of_one_new_toolset_writes_one_instruction_anchor(closed):
    key = tenant(closed, "burst")
    prompts = [system("burst") + user(f"Weather in city number {i}?") for i in range(32)]

    async def one(client: httpx.AsyncClient, messages) -> httpx.Response:
        return await client.post(closed.url + "/v1/chat/completions", json={
            "model": "default", "messages": messages, "tools": TOOLS, "temperature": 0,
            "max_tokens": 1}, headers={"Authorization": f"Bearer {key}"})

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(*(one(client, m) for m in prompts))

    replies = asyncio.run(burst())
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    rows = admin(closed, "GET", "/admin/anchors", params={"tenant": "burst", "status": "all"}).json()["data"]
    instruction = [r for r in rows if r["kind"] == "instruction"]
    assert len(instruction) == 1 and instruction[0]["status"] == "committed"
    depth = instruction[0]["depth"]
    assert sum(cached(r) == depth for r in replies) >= 31  # everyone but the writer restored it
    toolsets = admin(closed, "GET", "/admin/toolsets", params={"tenant": "burst"}).json()["data"]
    assert [t["toolset"] for t in toolsets] == [instruction[0]["key"]]
    stats = admin(closed, "GET", "/admin/stats").json()
    assert stats["ledger"]["reservations"].get("open", 0) == 0


@pytest.fixture()
def small_stack(default_model_dir) -> Iterator[Endpoint]:
    """A worker with 8 slots (2 thin) and a proxy in front."""
    with worker_process("--anchor-slots", "8", model=str(default_model_dir)) as w, \
            proxy_in_process(w.url) as p:
        yield p


def test_a_pinned_toolset_survives_other_tenants_traffic(small_stack):
    proxy = small_stack
    key = tenant(proxy, "pinner")
    made = admin(proxy, "POST", "/admin/tenants/pinner/toolsets",
                 json={"messages": system("pinned"), "tools": TOOLS, "pin": True})
    assert made.status_code == 200, made.text
    ts = made.json()
    assert ts["pinned"]
    other = tenant(proxy, "noisy")
    for i in range(12):  # many toolsets and conversations: far more anchors than slots
        chat(proxy, other, system(f"noisy {i}") + user(f"Weather in town {i}?"))
    slots = admin(proxy, "GET", "/admin/slots").json()["data"]
    pinned = [s for s in slots if s["key"] == ts["toolset"]]
    assert pinned and pinned[0]["pinned"] and pinned[0]["tenant"] == "pinner"
    noisy = admin(proxy, "GET", "/admin/anchors", params={"tenant": "noisy", "status": "evicted"})
    assert len(noisy.json()["data"]) > 0  # the pressure did evict
    assert cached(chat(proxy, key, system("pinned") + user("Weather in Bern?"))) == ts["anchor"]["depth"]
    # unpinned, it is ordinary again; unpinning twice is harmless
    assert admin(proxy, "POST", "/admin/unpin", json={"toolset": ts["toolset"]}).json()["pinned"] is False
    assert admin(proxy, "POST", "/admin/pin", json={"toolset": "nope"}).status_code == 404


def test_quotas_answer_429(closed):
    key = tenant(closed, "quota")
    assert admin(closed, "POST", "/admin/tenants/quota/quotas",
                 json={"max_in_flight": 1, "max_pinned_toolsets": 0}).status_code == 200

    async def two() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=600) as client:
            body = {"model": "default", "temperature": 0, "max_tokens": 120,
                    "messages": user("Count from 1 to 500, one number per line.")}
            headers = {"Authorization": f"Bearer {key}"}
            slow = asyncio.create_task(client.post(closed.url + "/v1/chat/completions",
                                                   json=body, headers=headers))
            async def busy() -> bool:
                tenants = (await client.get(closed.url + "/admin/tenants", headers=ADMIN)).json()
                return any(t["name"] == "quota" and t["in_flight"] for t in tenants["data"])

            for _ in range(2000):  # until the slow one is in flight
                if await busy():
                    break
            second = await client.post(closed.url + "/v1/chat/completions",
                                       json={**body, "max_tokens": 1}, headers=headers)
            return await slow, second

    first, second = asyncio.run(two())
    assert first.status_code == 200
    assert second.status_code == 429
    assert second.json()["error"]["code"] == "rate_limit_exceeded"
    assert "in flight" in second.json()["error"]["message"]
    assert chat(closed, key, user("hi")).status_code == 200  # the slot came back

    pinned = admin(closed, "POST", "/admin/tenants/quota/toolsets",
                   json={"messages": system("quota"), "tools": TOOLS, "pin": True})
    assert pinned.status_code == 429 and pinned.json()["error"]["code"] == "quota_exceeded"


def test_the_byte_quota_never_evicts_a_pinned_toolsets_tool_anchors(closed):
    """A toolset written by a request chains its instruction anchor on tool anchors; pinned,
    the whole chain stays through the tenant's anchor-bytes quota (even one it alone
    exceeds), which evicts the conversation anchors instead, and a new conversation still
    restores the toolset."""
    from anchorcache.testing.data import conversations

    key = tenant(closed, "bytes")
    tools = conversations("base")[0]["tools"][:16]
    assert chat(closed, key, system("bytes") + user("first"), tools).status_code == 200
    rows = admin(closed, "GET", "/admin/anchors", params={"tenant": "bytes"}).json()["data"]
    chain = [r for r in rows if r["kind"] in ("tool", "instruction")]
    assert [r["kind"] for r in sorted(chain, key=lambda r: r["depth"])][-1] == "instruction"
    assert len(chain) >= 3  # tool anchors under the instruction anchor
    (toolset,) = admin(closed, "GET", "/admin/toolsets", params={"tenant": "bytes"}).json()["data"]
    assert admin(closed, "POST", "/admin/pin", json={"toolset": toolset["toolset"]}).json()["pinned"]
    limit = sum(r["nbytes"] for r in chain) - 1  # even the chain alone is over it
    assert admin(closed, "POST", "/admin/tenants/bytes/quotas",
                 json={"max_anchor_bytes": limit}).status_code == 200
    for i in range(3):  # conversation anchors past the quota
        assert chat(closed, key, system("bytes") + user(f"question {i}"), tools).status_code == 200
    after = admin(closed, "GET", "/admin/anchors", params={"tenant": "bytes"}).json()["data"]
    assert {r["key"] for r in chain} <= {r["key"] for r in after}  # committed, every link
    assert any(r["kind"] == "conversation" for r in admin(
        closed, "GET", "/admin/anchors", params={"tenant": "bytes", "status": "evicted"}
    ).json()["data"])  # the quota did evict
    depth = max(r["depth"] for r in chain)
    assert cached(chat(closed, key, system("bytes") + user("a new one"), tools)) == depth


@pytest.mark.parametrize("header", ["X-Forwarded-For", "Forwarded", "X-Real-IP"])
def test_anonymous_access_is_for_callers_on_this_machine_only(proxy, header):
    """A proxy on loopback serves local callers without a key; behind a reverse proxy on the
    same machine (which says whom it forwards for), a remote client gets a 401, with no key
    or a placeholder one."""
    value = "for=203.0.113.9" if header == "Forwarded" else "203.0.113.9"
    assert chat(proxy, None, user("hi")).status_code == 200
    for key in (None, "EMPTY"):
        headers = {header: value, **({"Authorization": f"Bearer {key}"} if key else {})}
        resp = httpx.post(proxy.url + "/v1/chat/completions", headers=headers, timeout=300,
                          json={"model": "default", "messages": user("hi"), "max_tokens": 2})
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["type"] == "authentication_error"


def test_health_and_metrics_tell_the_public_nothing_about_other_tenants(proxy):
    """`/health` shows anyone whether the proxy serves, not the workers' URLs nor the ids of
    the requests they hold; `/metrics` (tenant names) is for this machine or the admin."""
    public = httpx.get(proxy.url + "/health", timeout=60).json()
    assert public["status"] == "ok"
    for worker in [public["worker"], *public["workers"]]:
        assert not {"url", "running_requests", "queued_requests"} & set(worker), worker
    full = admin(proxy, "GET", "/health").json()
    assert full["workers"][0]["url"] and "running_requests" in full["worker"]
    remote = {"X-Forwarded-For": "203.0.113.9"}
    assert httpx.get(proxy.url + "/metrics", headers=remote, timeout=60).status_code == 401
    assert httpx.get(proxy.url + "/metrics", headers={**remote, **ADMIN},
                     timeout=60).status_code == 200
    assert httpx.get(proxy.url + "/metrics", timeout=60).status_code == 200  # a local scraper


def test_one_tenants_traffic_cannot_evict_every_other_tenants_anchors(tmp_path):
    """Without a byte quota of its own a tenant holds at most half of the worker's anchor
    memory (the default `tenant_anchor_share`): a tenant sending far more than the worker
    holds evicts its own anchors, and a quiet tenant's anchors survive it. A tiny Qwen3 with
    1 MiB of anchor memory (512 bytes of KV a token)."""
    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir

    model = build_tiny_model("qwen3", tiny_model_dir("qwen3"))
    with worker_process("--anchor-slots", "64", "--anchor-bytes", str(1 << 20),
                        model=str(model)) as w, proxy_in_process(w.url) as proxy:
        quiet, noisy = tenant(proxy, "quiet"), tenant(proxy, "noisy")
        words = " ".join(f"word{i}" for i in range(150))
        asked = system("quiet") + user(f"Summarize: {words}")
        chat(proxy, quiet, asked)
        for i in range(10):  # about 4,000 tokens of anchors: twice what the worker holds
            chat(proxy, noisy, system(f"noisy {i}") + user(f"Summarize {i}: {words}"))
        rows = admin(proxy, "GET", "/admin/anchors", params={"tenant": "noisy"}).json()["data"]
        assert 0 < sum(r["nbytes"] for r in rows) <= (1 << 20) // 2, rows
        evicted = admin(proxy, "GET", "/admin/anchors",
                        params={"tenant": "noisy", "status": "evicted"}).json()["data"]
        assert evicted  # the noisy tenant paid with its own anchors
        again = chat(proxy, quiet, asked + [{"role": "assistant", "content": "Done."}]
                     + user("Thanks."))
        assert cached(again) > 100  # the quiet tenant's anchors survived


def test_a_second_proxy_on_one_ledger_refuses_to_start(worker, tmp_path):
    """Two proxies on one ledger would each close the other's open reservations as their
    own leftovers: the second (a process: its exit code is the subject) refuses to start,
    with a message naming the first's process (this one), and exit code 2."""
    import os
    import subprocess
    import sys

    from anchorcache.cli import free_port

    with proxy_in_process(worker.url, state_dir=str(tmp_path)) as first:
        done = subprocess.run([sys.executable, "-m", "anchorcache.cli", "proxy", "--worker",
                               worker.url, "--state-dir", str(tmp_path), "--port",
                               str(free_port())], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert "in use by another proxy" in done.stderr and f"(pid {os.getpid()})" in done.stderr
        assert "Traceback" not in done.stderr
        assert httpx.get(first.url + "/health", timeout=30).status_code == 200
