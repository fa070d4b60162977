"""`POST /v1/completions` against the session's real proxy and default worker (SmolLM2): raw
prompts (text and token ids, no chat template), streaming, logprobs, echo, a growing prompt
restored from its anchors, refusals, and the current OpenAI SDK's `completions.create`."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from anchorcache.proxy.completions_api import raw_split
from anchorcache.proxy.splitter.tokenizers import load_tokenizer
from anchorcache.proxy.splitter.types import CutKind
from anchorcache.testing.sdk import run_client
from anchorcache.testing.servers import tenant_key

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def complete(proxy, **body) -> dict:
    reply = httpx.post(proxy.url + "/v1/completions", timeout=300,
                       json={"model": "default", "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def stream(proxy, **body) -> list[dict]:
    with httpx.stream("POST", proxy.url + "/v1/completions", timeout=300,
                      json={"model": "default", "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(str(default_model_dir))


def test_a_text_prompt_is_completed_as_is(proxy, tokenizer):
    reply = complete(proxy, prompt=PROMPT, max_tokens=8)
    assert reply["object"] == "text_completion" and reply["id"].startswith("cmpl-")
    [choice] = reply["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert "Paris" in choice["text"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = reply["usage"]
    assert usage["prompt_tokens"] == len(tokenizer.encode(PROMPT))  # no template around it
    assert 0 < usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "cached_tokens" in usage["prompt_tokens_details"]
    assert usage["timings"]["prefill_tokens"] + usage["prompt_tokens_details"]["cached_tokens"] \
        == usage["prompt_tokens"]


def test_the_stream_gives_the_same_text_then_usage_and_done(proxy):
    whole = complete(proxy, prompt=PROMPT, max_tokens=8)
    chunks = stream(proxy, prompt=PROMPT, max_tokens=8, stream_options={"include_usage": True})
    assert all(c["object"] == "text_completion" for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == whole["choices"][0]["text"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks
              if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == [whole["choices"][0]["finish_reason"]]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_token_ids_give_the_same_output_as_their_text(proxy, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_text = complete(proxy, prompt=PROMPT, max_tokens=6)
    for prompt in (ids, [ids]):
        by_ids = complete(proxy, prompt=prompt, max_tokens=6)
        assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
        assert by_ids["usage"]["prompt_tokens"] == len(ids)
    assert complete(proxy, prompt=[PROMPT], max_tokens=6)["choices"][0]["text"] \
        == by_text["choices"][0]["text"]


def test_a_prompt_that_extends_the_last_one_restores_it(proxy):
    shots = "".join(f"Q: What is {a} plus {b}?\nA: {a + b}.\n\n" for a, b in
                    [(17, 25), (3, 94), (58, 11), (40, 40), (7, 66), (21, 32), (9, 13)])
    first = complete(proxy, prompt=shots + "Q: What is 12 plus 30?\nA:", max_tokens=4)
    n = first["usage"]["prompt_tokens"]
    assert n > 100
    longer = shots + "Q: What is 12 plus 30?\nA:" + first["choices"][0]["text"] \
        + "\n\nQ: What is 5 plus 6?\nA:"
    second = complete(proxy, prompt=longer, max_tokens=4)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * n
    assert second["usage"]["timings"]["anchor_hits"]


def test_logprobs_echo_and_n(proxy):
    reply = complete(proxy, prompt=PROMPT, max_tokens=4, logprobs=2)
    [choice] = reply["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
        == reply["usage"]["completion_tokens"] == 4  # (a stop token would have none)
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0 and all(v <= 0 for v in lp["token_logprobs"])
    for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
        assert token in top and 2 <= len(top) <= 3  # the top 2 and the sampled one
    echoed = complete(proxy, prompt=PROMPT, max_tokens=4, echo=True)
    assert echoed["choices"][0]["text"] == PROMPT + choice["text"]
    chunks = stream(proxy, prompt=PROMPT, max_tokens=4, echo=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + choice["text"]
    sampled = complete(proxy, prompt=PROMPT, max_tokens=3, n=2, temperature=1.0, seed=7)
    assert [c["index"] for c in sampled["choices"]] == [0, 1]
    assert sampled["usage"]["completion_tokens"] <= 6


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "hi", "suffix": "there"}, "suffix"),
    ({"prompt": "hi", "echo": True, "logprobs": 1}, "logprobs"),
    ({"prompt": "hi", "logprobs": 99}, "logprobs"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "echo": "yes"}, "echo"),
])
def test_bad_requests_are_400s_that_name_the_field(proxy, body, param):
    reply = httpx.post(proxy.url + "/v1/completions", json={"model": "default", **body},
                       timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


def test_token_ids_outside_the_vocabulary_are_a_400(proxy):
    reply = httpx.post(proxy.url + "/v1/completions", timeout=60,
                       json={"model": "default", "prompt": [1, 10**9], "max_tokens": 1})
    assert reply.status_code == 400, reply.text
    assert "vocabulary" in reply.json()["error"]["message"]


def test_raw_split_cuts_before_the_last_word_where_that_verifies(tokenizer):
    text = "The capital of France is Paris.\n\n"  # "\n\n" tokenizes otherwise when extended
    split = raw_split(tokenizer, text)
    assert split.input_ids == tuple(tokenizer.encode(text)) and split.adapter == "raw"
    [cut] = split.cuts
    assert cut.kind is CutKind.CONVERSATION
    extended = tokenizer.encode(text + "Next")
    assert tuple(extended[:cut.position]) == split.input_ids[:cut.position]
    assert tuple(extended[:len(split.input_ids)]) != split.input_ids
    assert raw_split(tokenizer, "word").cuts == ()
    assert raw_split(tokenizer, (5, 6, 7)).input_ids == (5, 6, 7)


def test_the_current_openai_sdk_completes(proxy):
    key = tenant_key(proxy, "completions-" + uuid.uuid4().hex[:8])  # the session's proxy has tenants
    done = run_client(f"""
        import openai
        client = openai.OpenAI(base_url="{proxy.url}/v1", api_key={key!r}, max_retries=0)
        reply = client.completions.create(model="default", prompt={PROMPT!r}, max_tokens=8,
                                          temperature=0)
        print("text", repr(reply.choices[0].text), reply.usage.prompt_tokens)
        chunks = list(client.completions.create(model="default", prompt={PROMPT!r},
                                                max_tokens=8, temperature=0, stream=True))
        print("streamed", "".join(c.choices[0].text for c in chunks) == reply.choices[0].text)
    """)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout and "streamed True" in done.stdout, done.stdout
