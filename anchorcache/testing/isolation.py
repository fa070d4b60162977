"""Tenant isolation, checked end to end through a proxy and its worker (any worker kind).

`check_tenants_stay_apart` sends one long agent prompt as several tenants, through both APIs,
and asserts what a tenant may learn about another's prompt from what comes back: nothing.
Used by the SGLang tests on each server configuration (dense, paged + TP, hybrid), whose
engine prefix cache is shared by every request it serves unless keyed by namespace.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from anchorcache.testing.data import conversations, turn_requests
from anchorcache.testing.servers import ADMIN, Server

SYSTEM = "You are a file-system agent. Call the tools to do what the user asks, then say Done."


def _tenant(proxy: Server, name: str) -> str:
    resp = httpx.post(proxy.url + "/admin/tenants", json={"name": name}, headers=ADMIN,
                      timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["api_key"]


def _chat(proxy: Server, key: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
          ) -> dict[str, Any]:
    resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=600,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "default", "messages": messages, "tools": tools,
                            "temperature": 0, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


def _messages(proxy: Server, key: str, system: str, user: str, tools: list[dict[str, Any]]
              ) -> dict[str, Any]:
    body = {"model": "default", "max_tokens": 2, "temperature": 0, "system": system,
            "messages": [{"role": "user", "content": user}],
            "tools": [{"name": t["function"]["name"],
                       "description": t["function"].get("description", ""),
                       "input_schema": t["function"].get("parameters", {"type": "object"})}
                      for t in tools]}
    resp = httpx.post(proxy.url + "/v1/messages", json=body, timeout=600,
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


def check_tenants_stay_apart(proxy: Server, worker_url: str) -> None:
    """Tenant A sends a BFCL agent prompt (about 4k tokens) twice; its repeat hits. Tenant
    B then sends exactly that prompt: `cached_tokens` 0 and no anchor hit, through chat
    completions; tenant C likewise through `/v1/messages` (`cache_read_input_tokens` 0),
    and C's own repeat hits. An admin then shares A's toolset, and a fourth tenant's first
    request with it restores that toolset's instruction anchor, exactly its depth. `proxy`
    must have the admin API on (`anchorcache.testing.servers.proxy_process` does)."""
    conv = conversations("base")[0]
    tools = conv["tools"]
    messages = [{"role": "system", "content": SYSTEM}, *turn_requests(conv, 1)[0]]
    assert [m["role"] for m in messages] == ["system", "user"]
    run = uuid.uuid4().hex[:8]
    a, b, c, d = (_tenant(proxy, f"iso-{name}-{run}") for name in "abcd")
    flush = httpx.post(worker_url + "/flush_cache", timeout=120)  # an empty engine cache
    assert flush.status_code == 200, flush.text

    first = _chat(proxy, a, messages, tools)
    assert first["prompt_tokens"] > 1000
    assert _chat(proxy, a, messages, tools)["prompt_tokens_details"]["cached_tokens"] > 0
    other = _chat(proxy, b, messages, tools)
    assert other["prompt_tokens"] == first["prompt_tokens"]
    assert other["prompt_tokens_details"]["cached_tokens"] == 0, other
    assert other["timings"]["anchor_hits"] == [], other

    system, user = messages[0]["content"], messages[1]["content"]
    third = _messages(proxy, c, system, user, tools)
    assert third["cache_read_input_tokens"] == 0, third
    assert _messages(proxy, c, system, user, tools)["cache_read_input_tokens"] > 0

    # shared on purpose: D (which never sent it) restores A's toolset, shared by an admin
    made = httpx.post(proxy.url + f"/admin/tenants/iso-a-{run}/toolsets", headers=ADMIN,
                      timeout=600, json={"messages": messages[:1], "tools": tools,
                                         "shared": True})
    assert made.status_code == 200, made.text
    depth = made.json()["anchor"]["depth"]
    shared = _chat(proxy, d, [messages[0], {"role": "user", "content": "And the rest?"}], tools)
    assert [h["kind"] for h in shared["timings"]["anchor_hits"]][-1:] == ["instruction"]
    assert shared["timings"]["anchor_hits"][-1]["depth"] == depth
    assert shared["prompt_tokens_details"]["cached_tokens"] >= depth - depth % 64, shared
