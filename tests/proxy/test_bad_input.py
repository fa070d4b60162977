"""Hostile bodies against a real proxy and worker: each is a 4xx with the OpenAI error
shape (never a 500 or 502), and the proxy answers the next request."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "What is the capital of France?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def nested_schema(levels: int) -> str:
    """JSON text of a schema nested `levels` objects deep (text: json.dumps would recurse)."""
    text = '{"type": "string"}'
    for _ in range(levels):
        text = '{"type": "object", "properties": {"x": ' + text + "}}"
    return text


def nested_value(levels: int) -> str:
    text = "1"
    for i in range(levels):
        text = ('{"a": ' + text + "}") if i % 2 else ("[" + text + "]")
    return text


class Raw(str):
    """JSON text to splice into a body verbatim."""


def encode(fields: dict[str, Any]) -> bytes:
    raws: dict[str, str] = {}

    def mark(value: Any) -> Any:
        if isinstance(value, Raw):
            raws[f"@raw{len(raws)}@"] = value
            return f"@raw{len(raws) - 1}@"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(fields))
    for name, raw in raws.items():
        text = text.replace(f'"{name}"', raw)
    return text.encode()


def calls_with(arguments: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


BAD = [
    ("role is a list", {"messages": [{"role": ["user"], "content": "hi"}]}),
    ("role is an object", {"messages": [{"role": {"user": 1}, "content": "hi"}]}),
    ("tool_choice name is a list", {"messages": HI, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": ["get_weather"]}}}),
    ("tool_choice name is an object", {"messages": HI, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": {"n": "get_weather"}}}}),
    ("tool_choice is a list", {"messages": HI, "tools": [TOOL], "tool_choice": ["auto"]}),
    ("parameters nested 500 levels", {"messages": HI, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": Raw(nested_schema(500))}}]}),
    ("arguments nested 1000 levels", {"messages": calls_with(Raw(nested_value(1000))),
                                      "tools": [TOOL]}),
    ("arguments string nested 1000 levels", {
        "messages": calls_with('{"city": ' + nested_value(1000) + "}"), "tools": [TOOL]}),
    ("arguments string nested 2000 levels", {
        "messages": calls_with(nested_value(2000)), "tools": [TOOL]}),
    ("arguments string nested 990 levels, invalid at the end", {
        "messages": calls_with(nested_value(990)[:-1]), "tools": [TOOL]}),
    ("tool name is a list", {"messages": HI, "tools": [
        {"type": "function", "function": {"name": ["f"]}}]}),
    ("message name is an object", {"messages": [{"role": "user", "content": "hi", "name": {}}]}),
    ("template kwarg shadows messages", {"messages": HI,
                                         "chat_template_kwargs": {"messages": []}}),
    ("template kwarg shadows a special token", {"messages": HI,
                                                "chat_template_kwargs": {"eos_token": "x"}}),
    ("n is a list", {"messages": HI, "n": [1]}),
    ("stop is too long", {"messages": HI, "stop": ["x" * 5000]}),
]


@pytest.mark.parametrize("name,fields", BAD, ids=[b[0] for b in BAD])
def test_hostile_body_is_400(proxy, name, fields):
    resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=60,
                      content=encode({"model": "default", "max_tokens": 2, **fields}),
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_request"
    assert isinstance(err["message"], str) and err["message"]
    assert httpx.get(proxy.url + "/health", timeout=30).status_code == 200


def test_gzip_label_on_a_plain_body_is_400(proxy):
    data = json.dumps({"model": "default", "messages": HI, "max_tokens": 2}).encode()
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    bad = httpx.post(proxy.url + "/v1/chat/completions", content=data, headers=headers, timeout=60)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["type"] == "invalid_request_error"
    good = httpx.post(proxy.url + "/v1/chat/completions", content=gzip.compress(data),
                      headers=headers, timeout=60)
    assert good.status_code == 200, good.text


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-7])
def test_a_near_zero_temperature_is_greedy(proxy, temperature):
    def reply(t: float) -> str:
        resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=120, json={
            "model": "default", "messages": HI, "max_tokens": 12, "temperature": t, "seed": 1})
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["message"]["content"]

    assert reply(temperature) == reply(0.0)


def test_a_schema_at_a_realistic_depth_is_accepted(proxy):
    resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=120, content=encode({
        "model": "default", "messages": HI, "max_tokens": 2, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": Raw(nested_schema(20))}}]}),
        headers={"Content-Type": "application/json"})
    assert resp.status_code == 200, resp.text
