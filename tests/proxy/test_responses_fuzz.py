"""Property: no body sent to `/v1/responses` makes the proxy answer a 5xx, every refusal is an
OpenAI error object, every stream ends with its final event, and the proxy keeps answering.

Hypothesis draws Responses bodies (mostly well-formed, fields sometimes replaced by any JSON:
tests/proxy/test_responses_schema.py), deeply nested tool schemas and call arguments, unknown
previous_response_ids, raw bytes and bodies labelled gzip that are not, derandomized, sent to
the session's proxy in front of the real default worker; valid bodies generate one token.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import orjson
import pytest
from hypothesis import settings
from hypothesis import strategies as st

from anchorcache.testing.bodies import RESPONSES_WEATHER as WEATHER
from anchorcache.testing.bodies import responses_bodies
from anchorcache.testing.fuzz import FUZZ as BASE_FUZZ
from anchorcache.testing.fuzz import deep_schema, fuzz_route
from anchorcache.testing.servers import ADMIN

pytestmark = pytest.mark.slow

JSON_HEADERS = {"Content-Type": "application/json"}
FINAL_EVENTS = (b"event: response.completed\n", b"event: response.incomplete\n")


def _one_token(body: Any) -> Any:
    return {**body, "max_output_tokens": 1} if isinstance(body, dict) else body


deep_body = st.integers(40, 400).map(lambda n: {
    "model": "default", "max_output_tokens": 1, "tools": [{**WEATHER, "parameters": deep_schema(n)}],
    "input": [{"role": "user", "content": "q"},
              {"type": "function_call", "call_id": "c1", "name": "get_weather",
               "arguments": json.dumps(deep_schema(n))},
              {"type": "function_call_output", "call_id": "c1", "output": "ok"}]})


def _sent(body: Any, gzipped: bool) -> tuple[bytes, dict[str, str]]:
    """A body as sent: JSON bytes, or those gzipped (and labelled so)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    if gzipped:
        return gzip.compress(data), {**JSON_HEADERS, "Content-Encoding": "gzip"}
    return data, JSON_HEADERS


# mostly valid bodies of one token (some continuing an unknown response), then deep
# schemas, raw bytes, and bytes labelled gzip that are not
bodies = st.one_of(responses_bodies, responses_bodies, responses_bodies.map(lambda b: {**b, "previous_response_id": "resp_no"})
                   ).map(_one_token)
encoded = st.one_of(
    st.tuples(bodies, st.sampled_from([False, False, False, True])),
    st.tuples(deep_body, st.just(False)),
    st.tuples(st.binary(max_size=64), st.booleans()),
).map(lambda case: _sent(*case))
FUZZ = settings(BASE_FUZZ, max_examples=150)


async def test_no_body_gets_a_5xx_and_the_proxy_keeps_answering(client):
    def check(status: int, raw: bytes, data: bytes) -> None:
        if raw.startswith(b"event: "):  # a stream: whole, ending with its final event
            last = raw[raw.rindex(b"event: "):]
            assert status == 200 and last.startswith(FINAL_EVENTS), raw[-500:]
            return
        body = orjson.loads(raw)
        if status >= 400:
            error = body["error"]
            assert error["type"] == "invalid_request_error" and error["message"], raw[:300]
            assert set(error) == {"message", "type", "code", "param"}
        else:
            assert body["object"] == "response" and body["usage"]["output_tokens"] == 1

    seen = await fuzz_route(client, "/v1/responses", encoded, FUZZ, check)
    assert seen.get(200, 0) >= 15, seen  # some bodies were valid and generated
    assert sum(n for s, n in seen.items() if 400 <= s < 500) >= 60, seen
    ok = await client.post("/v1/responses",
                           json={"model": "default", "max_output_tokens": 1, "input": "hi"})
    assert ok.status == 200, await ok.text()
    health = await (await client.get("/health", headers=ADMIN)).json()
    assert health["worker"]["running_requests"] == [] and health["worker"]["queued_requests"] == []
