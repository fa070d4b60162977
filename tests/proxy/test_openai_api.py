"""The walking skeleton end to end: real worker + real proxy + the official openai SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_capital_of_france_greedy(openai_client):
    reply = openai_client.chat.completions.create(model="default", messages=FRANCE,
                                                  temperature=0, max_tokens=20)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens > 0


def test_prompt_tokens_equal_the_templates_count(openai_client, default_model_dir):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    expected = len(tok.apply_chat_template(FRANCE, add_generation_prompt=True)["input_ids"])
    reply = openai_client.chat.completions.create(model="default", messages=FRANCE,
                                                  temperature=0, max_tokens=5)
    assert reply.usage.prompt_tokens == expected
    assert reply.usage.total_tokens == expected + reply.usage.completion_tokens


def test_stream_and_non_stream_give_the_same_text(openai_client):
    messages = [{"role": "user", "content": "Name three colors and say why you like them."}]
    whole = openai_client.chat.completions.create(model="default", messages=messages,
                                                  temperature=0, max_tokens=48)
    chunks = list(openai_client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=48, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]


def test_streamed_unicode_is_never_split(openai_client):
    """Characters whose bytes span several tokens (SmolLM2 spells 🎉 in 3, 日本 in 4), forced by
    a schema so the model cannot answer in ASCII, arrive whole: no chunk holds part of one."""
    words = "naïve 🎉 日本"
    schema = {"type": "object", "properties": {"w": {"type": "string", "enum": [words]}},
              "required": ["w"], "additionalProperties": False}
    chunks = openai_client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Say it."}], temperature=0,
        max_tokens=40, stream=True, response_format={
            "type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": schema}})
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert all("\ufffd" not in p for p in pieces), pieces
    text = "".join(pieces)
    assert words in text and json.loads(text) == {"w": words}, pieces


def test_models_lists_the_served_model(openai_client, worker):
    ids = [m.id for m in openai_client.models.list()]
    info = httpx.get(worker.url + "/model_info").json()
    assert ids == [info["model_id"]]
    reply = openai_client.chat.completions.create(model=info["model_id"], messages=FRANCE,
                                                  temperature=0, max_tokens=3)
    assert reply.model == info["model_id"]


def test_unknown_model_is_404(openai_client):
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.chat.completions.create(model="gpt-17", messages=FRANCE)
    assert e.value.body["code"] == "model_not_found"


def test_seeded_sampling_is_reproducible(openai_client):
    kw = dict(model="default", messages=FRANCE, temperature=1.0, top_p=0.9, max_tokens=16, seed=7)
    a = openai_client.chat.completions.create(**kw).choices[0].message.content
    b = openai_client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_stop_string_truncates(openai_client):
    base = openai_client.chat.completions.create(model="default", messages=FRANCE, temperature=0,
                                                 max_tokens=20).choices[0].message.content
    word = base.split()[2]
    reply = openai_client.chat.completions.create(model="default", messages=FRANCE, temperature=0,
                                                  max_tokens=20, stop=[word])
    assert reply.choices[0].message.content == base[: base.index(word)]
    assert reply.choices[0].finish_reason == "stop"


BAD = [
    ("not json", b"{nope", 400, "invalid_json"),
    ("missing messages", {"model": "default"}, 400, "invalid_request"),
    ("empty messages", {"model": "default", "messages": []}, 400, "invalid_request"),
    ("messages not a list", {"model": "default", "messages": "hi"}, 400, "invalid_request"),
    ("message not an object", {"model": "default", "messages": ["hi"]}, 400, "invalid_request"),
    ("unknown role", {"model": "default", "messages": [{"role": "wizard", "content": "x"}]},
     400, "invalid_request"),
    ("content wrong type", {"model": "default", "messages": [{"role": "user", "content": 5}]},
     400, "invalid_request"),
    ("temperature wrong type", {"model": "default", "messages": FRANCE, "temperature": "hot"},
     400, "invalid_request"),
    ("max_tokens zero", {"model": "default", "messages": FRANCE, "max_tokens": 0},
     400, "invalid_request"),
    ("max_tokens negative", {"model": "default", "messages": FRANCE, "max_tokens": -3},
     400, "invalid_request"),
    ("max_tokens not int", {"model": "default", "messages": FRANCE, "max_tokens": 1.5},
     400, "invalid_request"),
    ("model missing", {"messages": FRANCE}, 400, "invalid_request"),
    ("unknown model", {"model": "nope", "messages": FRANCE}, 404, "model_not_found"),
    ("n > 16", {"model": "default", "messages": FRANCE, "n": 17}, 400, "invalid_request"),
    ("top_logprobs without logprobs", {"model": "default", "messages": FRANCE,
                                       "top_logprobs": 2}, 400, "invalid_request"),
    ("bad response_format schema", {"model": "default", "messages": FRANCE, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     400, "invalid_request"),
    ("bad regex", {"model": "default", "messages": FRANCE, "regex": "(a"}, 400,
     "invalid_request"),
    ("bad ebnf", {"model": "default", "messages": FRANCE, "ebnf": "root ::= "}, 400,
     "invalid_request"),
    ("tools not a list", {"model": "default", "messages": FRANCE, "tools": {}}, 400, "invalid_request"),
    ("bad tool-call arguments", {"model": "default", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, 400, "invalid_request"),
    ("body over the limit", {"model": "default", "messages": [
        {"role": "user", "content": "x" * 70000}]}, 413, "request_too_large"),
]


@pytest.mark.parametrize("name,body,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(proxy, name, body, status, code):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(proxy.url + "/v1/chat/completions", content=data,
                      headers={"Content-Type": "application/json"}, timeout=60)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    assert httpx.get(proxy.url + "/health", timeout=30).status_code == 200


def test_context_overflow_is_400(proxy):
    messages = [{"role": "user", "content": "word " * 9000}]
    resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=60,
                      json={"model": "default", "messages": messages, "max_tokens": 10})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_path_is_404_json(proxy):
    resp = httpx.get(proxy.url + "/v1/nothing-here")
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "not_found"
