"""Property: no request body makes the proxy answer a 5xx, and the proxy keeps answering.

Hypothesis draws well over a thousand `/v1/chat/completions` bodies per run, derandomized
(the same bodies every run, in CI too): near-valid requests with fields replaced by
arbitrary JSON, deeply nested tool schemas and tool-call arguments (as objects and as JSON
strings), odd sampling values, raw bytes and bodies labelled gzip that are not. A real proxy
runs in-process (aiohttp's test client) in front of the real default worker; most bodies are
refused before generation, and those that are valid generate one token.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import orjson
import pytest
from hypothesis import settings
from hypothesis import strategies as st

from anchorcache.testing.bodies import any_json, maybe, scalars, temperature, text
from anchorcache.testing.fuzz import FUZZ as BASE_FUZZ
from anchorcache.testing.fuzz import fuzz_route
from anchorcache.testing.servers import ADMIN

pytestmark = pytest.mark.slow


ROLES = ["system", "developer", "user", "assistant", "tool"]

class Raw(str):
    """JSON text spliced into a body verbatim (json.dumps would recurse on deep values)."""


@st.composite
def deep(draw: Any) -> Raw:
    """Objects/arrays nested 40 to 1,500 levels (the limit is 64), as JSON text."""
    depth = draw(st.integers(40, 1500))
    text = json.dumps(draw(scalars))
    for i in range(depth):
        text = ('{"type": "object", "properties": {"x": ' + text + "}}") if i % 2 \
            else ("[" + text + "]")
    return Raw(text)


def json_string(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[str]:
    return strategy.map(lambda v: str(v) if isinstance(v, Raw) else json.dumps(v))


name = st.from_regex(r"[a-z_]{1,10}", fullmatch=True)
arguments = st.one_of(json_string(st.dictionaries(name, scalars, max_size=3)), text,
                      json_string(deep()), deep(), any_json, st.just("{not json"))
tool_call = st.fixed_dictionaries(
    {"id": maybe(name), "type": maybe(st.just("function")),
     "function": maybe(st.fixed_dictionaries({"name": maybe(name), "arguments": arguments}))})
content = st.one_of(text, text, st.none(),
                    st.lists(st.fixed_dictionaries({"type": maybe(st.just("text")),
                                                    "text": maybe(text)}), max_size=2),
                    any_json)
message = st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(ROLES)), "content": content},
    optional={"name": maybe(name, True), "tool_calls": maybe(st.lists(tool_call, max_size=2), True),
              "tool_call_id": maybe(name, True)})
tool = st.fixed_dictionaries(
    {"type": maybe(st.just("function")),
     "function": maybe(st.fixed_dictionaries(
         {"name": maybe(name)},
         optional={"description": maybe(text, True),
                   "parameters": st.one_of(st.just({"type": "object", "properties": {}}),
                                           deep(), any_json)}))})
tool_choice = st.one_of(st.sampled_from(["auto", "none", "required"]),
                        st.fixed_dictionaries({"type": st.just("function"),
                                               "function": st.fixed_dictionaries({"name": maybe(name)})}),
                        any_json)
one_token = st.one_of(st.just(1), st.integers(-5, 0), st.integers(1 << 40, 1 << 70), any_json)

body = st.fixed_dictionaries(
    {"model": maybe(st.just("default")),
     "messages": maybe(st.lists(message, min_size=1, max_size=3)),
     "max_tokens": one_token},
    optional={"temperature": temperature, "top_p": maybe(st.floats(0, 1)),
              "top_k": maybe(st.integers(-3, 100)), "seed": maybe(st.integers(-(1 << 64), 1 << 64)),
              "n": maybe(st.just(1), True), "stop": maybe(st.lists(text, max_size=5) | text, True),
              "stream": maybe(st.booleans()), "stream_options": maybe(st.just({"include_usage": True}), True),
              "tools": maybe(st.lists(tool, max_size=2), True), "tool_choice": tool_choice,
              "chat_template_kwargs": maybe(st.dictionaries(name, scalars, max_size=2), True),
              "response_format": maybe(st.just({"type": "text"}), True),
              "max_completion_tokens": one_token})

# valid requests (one token each): the parts of the pipeline past validation see variety too
valid_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]),
                                       "content": text})
valid_tool = st.fixed_dictionaries(
    {"type": st.just("function"),
     "function": st.fixed_dictionaries({"name": name, "description": text,
                                        "parameters": st.just({"type": "object", "properties": {
                                            "q": {"type": "string"}}})})})
valid_body = st.fixed_dictionaries(
    {"model": st.just("default"), "max_tokens": st.just(1),
     "messages": st.lists(valid_message, min_size=1, max_size=3).map(
         lambda ms: [*ms, {"role": "user", "content": "hi"}])},
    optional={"temperature": temperature.filter(lambda t: isinstance(t, float) and 0 <= t <= 2),
              "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
              "seed": st.integers(0, 1 << 32), "stream": st.booleans(),
              "tools": st.lists(valid_tool, max_size=2, unique_by=lambda t: t["function"]["name"]),
              "stop": st.lists(st.text(min_size=1, max_size=5), max_size=4)})

Encoded = tuple[bytes, dict[str, str]]
JSON_HEADERS = {"Content-Type": "application/json"}


def _encode(value: Any) -> bytes:
    raws: list[str] = []

    def mark(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(v)
            return f"@raw{len(raws) - 1}@"
        if isinstance(v, dict):
            return {k: mark(x) for k, x in v.items()}
        if isinstance(v, list):
            return [mark(x) for x in v]
        return v

    text = json.dumps(mark(value))
    for i, raw in enumerate(raws):
        text = text.replace(f'"@raw{i}@"', raw, 1)
    return text.encode("utf-8", "surrogatepass")


hostile: st.SearchStrategy[Encoded] = st.one_of(
    body.map(lambda b: (_encode(b), JSON_HEADERS)),
    body.map(lambda b: (_encode(b), JSON_HEADERS)),
    body.map(lambda b: (_encode(b), JSON_HEADERS)),
    body.map(lambda b: (gzip.compress(_encode(b)), {**JSON_HEADERS, "Content-Encoding": "gzip"})),
    any_json.map(lambda b: (_encode(b), JSON_HEADERS)),
    st.binary(max_size=64).map(lambda b: (b, JSON_HEADERS)),
    st.binary(max_size=64).map(lambda b: (b, {**JSON_HEADERS, "Content-Encoding": "gzip"})),
)
valid: st.SearchStrategy[Encoded] = valid_body.map(lambda b: (_encode(b), JSON_HEADERS))
# about one body in 16 is valid (it costs a prefill on the worker); the rest are refused early
encoded = st.integers(0, 15).flatmap(lambda i: valid if i == 0 else hostile)

FUZZ = settings(BASE_FUZZ, max_examples=1200)


async def test_no_body_gets_a_5xx_and_the_proxy_keeps_answering(refusing_client, worker):
    def check(status: int, raw: bytes, data: bytes) -> None:
        if status >= 400:
            err = orjson.loads(raw)["error"]
            assert err["type"] == "invalid_request_error" and err["message"], raw[:300]

    seen = await fuzz_route(refusing_client, "/v1/chat/completions", encoded, FUZZ, check)
    assert sum(seen.values()) >= 1000
    assert seen.get(200, 0) >= 30, seen  # some bodies were valid and generated
    assert sum(n for s, n in seen.items() if 400 <= s < 500) >= 500, seen
    ok = await refusing_client.post("/v1/chat/completions", json={
        "model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status == 200
    health = await refusing_client.get("/health", headers=ADMIN)  # (request ids: the admin's)
    assert health.status == 200
    worker_health = (await health.json())["worker"]
    assert worker_health["running_requests"] == [] and worker_health["queued_requests"] == []
