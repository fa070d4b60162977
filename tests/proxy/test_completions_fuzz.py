"""Property: no `/v1/completions` body makes the proxy answer a 5xx, and it keeps answering.

Derandomized hypothesis bodies (the same every run): near-valid requests with fields
replaced by arbitrary JSON, prompts as text, token ids (in and out of the vocabulary, huge,
negative, booleans), nested and batched lists, odd sampling values, raw bytes and bodies
labelled gzip that are not. A real proxy in-process in front of the session's real worker
(tests/proxy/conftest.py's `refusing_client`); valid bodies generate one token.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import orjson
import pytest
from hypothesis import settings
from hypothesis import strategies as st

from anchorcache.testing.bodies import any_json, maybe, temperature, text
from anchorcache.testing.fuzz import FUZZ as BASE_FUZZ
from anchorcache.testing.fuzz import fuzz_route
from anchorcache.testing.servers import ADMIN

pytestmark = pytest.mark.slow

JSON_HEADERS = {"Content-Type": "application/json"}
# no accepted max_tokens above 1: text prompts are mostly valid here, and a large max_tokens
# would generate up to the context (clamped to the room the prompt leaves)
one_token = st.one_of(st.just(1), st.just(1), st.integers(-5, 0), st.integers(1 << 63, 1 << 70),
                      st.floats(0, 2), st.booleans(), st.text(max_size=3))
token_id = st.one_of(st.integers(0, 49_151), st.integers(0, 49_151), st.integers(-3, 1 << 40),
                     st.booleans(), st.floats(0, 10), st.text(max_size=3))
ids = st.lists(token_id, max_size=6)
prompt = st.one_of(text, text, ids, st.lists(text, max_size=3), st.lists(ids, max_size=2),
                   any_json)
body = st.fixed_dictionaries(
    {"model": maybe(st.just("default")), "prompt": prompt, "max_tokens": one_token},
    optional={"temperature": temperature, "top_p": maybe(st.floats(0, 1)),
              "top_k": maybe(st.integers(-3, 100)), "seed": maybe(st.integers(-(1 << 64), 1 << 64)),
              "n": maybe(st.integers(1, 2), True), "stop": maybe(st.lists(text, max_size=5) | text, True),
              "logprobs": maybe(st.integers(-1, 25) | st.none(), True),
              "echo": maybe(st.booleans(), True), "suffix": maybe(st.none(), True),
              "best_of": maybe(st.integers(0, 3), True), "stream": maybe(st.booleans()),
              "stream_options": maybe(st.just({"include_usage": True}), True),
              "cache_salt": maybe(st.text(min_size=1, max_size=8), True)})
valid_body = st.fixed_dictionaries(
    {"model": st.just("default"), "max_tokens": st.just(1),
     "prompt": st.one_of(st.text(min_size=1, max_size=40),
                         st.lists(st.integers(0, 49_151), min_size=1, max_size=8))},
    optional={"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
              "seed": st.integers(0, 1 << 32), "stream": st.booleans(), "echo": st.booleans(),
              "stop": st.lists(st.text(min_size=1, max_size=5), max_size=4)})


def _encode(value: Any) -> bytes:
    return json.dumps(value).encode("utf-8", "surrogatepass")


hostile = st.one_of(
    body.map(lambda b: (_encode(b), JSON_HEADERS)),
    body.map(lambda b: (_encode(b), JSON_HEADERS)),
    body.map(lambda b: (gzip.compress(_encode(b)), {**JSON_HEADERS, "Content-Encoding": "gzip"})),
    any_json.map(lambda b: (_encode(b), JSON_HEADERS)),
    st.binary(max_size=64).map(lambda b: (b, JSON_HEADERS)),
)
# about one body in 8 is valid (a one-token generation on the worker); the rest are refused
encoded = st.integers(0, 7).flatmap(
    lambda i: valid_body.map(lambda b: (_encode(b), JSON_HEADERS)) if i == 0 else hostile)

FUZZ = settings(BASE_FUZZ, max_examples=250)


async def test_no_completions_body_gets_a_5xx_and_the_proxy_keeps_answering(refusing_client):
    def check(status: int, raw: bytes, data: bytes) -> None:
        if raw.startswith(b"data: "):  # a stream: whole, no error in it
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw
            assert b'"error"' not in raw, raw[:500]
            return
        reply = orjson.loads(raw)
        if status >= 400:
            err = reply["error"]
            assert err["type"] == "invalid_request_error" and err["message"], raw[:300]
        else:
            assert reply["object"] == "text_completion", raw[:300]

    seen = await fuzz_route(refusing_client, "/v1/completions", encoded, FUZZ, check)
    assert seen.get(200, 0) >= 30, seen
    assert sum(n for s, n in seen.items() if 400 <= s < 500) >= 150, seen
    ok = await refusing_client.post("/v1/completions", json={
        "model": "default", "prompt": "hi", "max_tokens": 1})
    assert ok.status == 200
    health = await (await refusing_client.get("/health", headers=ADMIN)).json()
    assert health["worker"]["running_requests"] == [] and health["worker"]["queued_requests"] == []
