"""Agent turns replayed through a proxy, shared by the embedded worker's tests (tests/proxy)
and the SGLang worker's (tests/e2e): forced tool calls over the shared data's tools, a
response schema, and a turn ended by a stop string followed by the next turn."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from anchorcache.proxy.tenants import ANONYMOUS
from anchorcache.testing.data import conversations, turn_requests
from anchorcache.testing.metrics import delta, scrape, value
from anchorcache.testing.servers import Endpoint

CHAT = "/v1/chat/completions"
# a trip's arguments, as a response schema
TRIP = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 30}},
        "required": ["city", "days"], "additionalProperties": False}


def chat(proxy: Endpoint, messages: list[dict[str, Any]], *,
         headers: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    """A greedy chat completion through `proxy` (`kw`: more of the body); its reply."""
    resp = httpx.post(proxy.url + CHAT, timeout=300, headers=headers, json={
        "model": "default", "messages": messages, "temperature": 0, **kw})
    assert resp.status_code == 200, resp.text
    return resp.json()


def agent_cases(k: int) -> list[tuple[list[dict], list[dict], str]]:
    """(messages, tools, name of the tool the data calls next): one turn of each of the
    first k BFCL conversations whose next assistant turn calls a tool; the tools are that
    tool and three others of the conversation, so prompts stay ~700 tokens."""
    out = []
    for conv in conversations("base"):
        for msgs in turn_requests(conv, 3):
            calls = conv["messages"][len(msgs)].get("tool_calls")
            if calls:
                name = calls[0]["function"]["name"]
                tools = [t for t in conv["tools"] if t["function"]["name"] == name]
                tools += [t for t in conv["tools"] if t["function"]["name"] != name][:3]
                out.append((msgs, tools, name))
                break
        if len(out) == k:
            return out
    raise AssertionError("not enough agent turns in the shared data")


def validate_calls(message: Any, tools: list[dict]) -> None:
    """`message` calls tools, and each call's arguments validate against its tool's schema."""
    import jsonschema

    from anchorcache.proxy.structured import normalize_schema

    assert message.tool_calls, message
    schemas = {t["function"]["name"]: normalize_schema(t["function"]["parameters"]) for t in tools}
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def stop_then_next_turn(stopper: Endpoint, model_dir: Path, stream: bool,
                        flush: Callable[[], None] = lambda: None) -> None:
    """A greedy turn of the default model ended by a stop string, then the next turn.
    `flush` runs before each anchored request (SGLang: empties its device tree, so what the
    next turn finds comes from the host anchors)."""
    # a system prompt of its own: no earlier anchor of this conversation exists
    messages = [{"role": "system", "content": f"You are assistant {uuid.uuid4().hex[:8]}."},
                {"role": "user", "content": "What is the capital of France?"}]
    stop = " is"
    # the same greedy reply without the stop string, anchors off (it saves nothing)
    unstopped = chat(stopper, messages, max_tokens=64, headers={"X-Anchorcache-Anchors": "off"}
                     )["choices"][0]["message"]["content"]
    assert stop in unstopped, unstopped  # so the stop string ends the reply early
    flush()
    before = scrape(stopper)
    body: dict[str, Any] = {"max_tokens": 64, "stop": [stop]}
    if stream:
        events = []
        with httpx.stream("POST", stopper.url + CHAT, timeout=300, json={
                "model": "default", "messages": messages, "temperature": 0, **body,
                "stream": True, "stream_options": {"include_usage": True}}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        answer = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        usage = events[-1]["usage"]
    else:
        choice, usage = (reply := chat(stopper, messages, **body))["choices"][0], reply["usage"]
        answer, finish = choice["message"]["content"], [choice["finish_reason"]]
    assert finish == ["stop"]
    assert answer == unstopped[:unstopped.index(stop)]
    d = delta(scrape(stopper), before)
    assert value(d, "anchorcache_reservations_total", tenant=ANONYMOUS, outcome="confirmed",
                 reason="stop_sequence") == 1
    assert value(d, "anchorcache_reservations_total", tenant=ANONYMOUS, outcome="aborted",
                 reason="stop_sequence") == 0
    assert value(d, "anchorcache_snapshots_total", tenant=ANONYMOUS, kind="response") == 1

    flush()
    before = scrape(stopper)
    nxt = chat(stopper, [*messages, {"role": "assistant", "content": answer},
                         {"role": "user", "content": "And of Italy?"}], max_tokens=1)
    # the previous prompt, generation prompt included, and the reply up to the stop string
    # are where the next one starts: the response anchor holds exactly those tokens
    from transformers import AutoTokenizer

    reply_ids = AutoTokenizer.from_pretrained(model_dir)(answer, add_special_tokens=False
                                                                 )["input_ids"]
    assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        usage["prompt_tokens"] + len(reply_ids)
    assert value(delta(scrape(stopper), before), "anchorcache_anchor_hits_total",
                 tenant=ANONYMOUS, kind="response") == 1
