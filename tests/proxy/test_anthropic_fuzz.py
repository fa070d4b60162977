"""Property: no body sent to `/v1/messages` makes the proxy answer a 5xx, every refusal is an
Anthropic error object, and the proxy keeps answering.

Hypothesis draws Anthropic bodies (mostly well-formed, fields sometimes replaced by any JSON:
anchorcache.testing.bodies), deeply nested tool schemas and tool inputs, raw bytes
and bodies labelled gzip that are not, derandomized. A real proxy runs in-process in front
of the real default worker; valid bodies generate one token.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import orjson
import pytest
from hypothesis import settings
from hypothesis import strategies as st

from anchorcache.testing.bodies import ANTHROPIC_WEATHER as WEATHER
from anchorcache.testing.bodies import anthropic_bodies
from anchorcache.testing.fuzz import FUZZ as BASE_FUZZ
from anchorcache.testing.fuzz import deep_schema, fuzz_route
from anchorcache.testing.servers import ADMIN

pytestmark = pytest.mark.slow


JSON_HEADERS = {"Content-Type": "application/json"}


def _one_token(body: Any) -> Any:
    return {**body, "max_tokens": 1} if isinstance(body, dict) and body.get("max_tokens") == 16 \
        else body


deep_body = st.integers(40, 400).map(lambda n: {
    "model": "default", "max_tokens": 1,
    "tools": [{**WEATHER, "input_schema": deep_schema(n)}],
    "messages": [{"role": "user", "content": "q"},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                    "name": "get_weather", "input": deep_schema(n)}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]})
encoded = st.one_of(
    anthropic_bodies.map(lambda b: (json.dumps(_one_token(b)).encode(), JSON_HEADERS)),
    anthropic_bodies.map(lambda b: (json.dumps(_one_token(b)).encode(), JSON_HEADERS)),
    anthropic_bodies.map(lambda b: (json.dumps(_one_token(b)).encode(), JSON_HEADERS)),
    anthropic_bodies.map(lambda b: (gzip.compress(json.dumps(_one_token(b)).encode()),
                         {**JSON_HEADERS, "Content-Encoding": "gzip"})),
    deep_body.map(lambda b: (json.dumps(b).encode(), JSON_HEADERS)),
    st.binary(max_size=64).map(lambda b: (b, JSON_HEADERS)),
    st.binary(max_size=64).map(lambda b: (b, {**JSON_HEADERS, "Content-Encoding": "gzip"})),
)
FUZZ = settings(BASE_FUZZ, max_examples=250)


async def test_no_body_gets_a_5xx_and_the_proxy_keeps_answering(client):
    def check(status: int, raw: bytes, data: bytes) -> None:
        if raw.startswith(b"event: "):  # a stream: whole, ending with message_stop
            assert status == 200 and raw.endswith(b'data: {"type":"message_stop"}\n\n'), raw
            return
        body = orjson.loads(raw)
        if status >= 400:
            assert body["type"] == "error", raw[:300]
            assert body["error"]["type"] in ("invalid_request_error", "not_found_error",
                                             "request_too_large") and body["error"]["message"]
        else:
            assert body["type"] == "message" and body["usage"]["output_tokens"] == 1

    seen = await fuzz_route(client, "/v1/messages", encoded, FUZZ, check)
    assert seen.get(200, 0) >= 60, seen  # some bodies were valid and generated
    assert sum(n for s, n in seen.items() if 400 <= s < 500) >= 120, seen
    ok = await client.post("/v1/messages", json={
        "model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status == 200
    # (the workers' request ids are the admin's to see)
    health = await (await client.get("/health", headers=ADMIN)).json()
    assert health["worker"]["running_requests"] == [] and health["worker"]["queued_requests"] == []
