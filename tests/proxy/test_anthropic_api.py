"""`POST /v1/messages` end to end: the official anthropic SDK against the real proxy and the
real embedded worker (SmolLM2), on the same anchors as chat completions."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import pytest
from transformers import AutoTokenizer

from anchorcache.testing.inprocess import proxy_in_process
from anchorcache.testing.servers import tenant_key

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Current weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
WEATHER_OPENAI = [{"type": "function", "function": {
    "name": WEATHER["name"], "description": WEATHER["description"],
    "parameters": WEATHER["input_schema"]}}]
CC = {"type": "ephemeral"}
# the SDK no longer has sampling arguments; the API (and this proxy) still takes them
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def key(proxy) -> str:
    """Anthropic clients always send a key: one tenant's, shared by both SDKs here."""
    return tenant_key(proxy, "anthropic-" + uuid.uuid4().hex[:8])


@pytest.fixture()
def client(proxy, key):
    return anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture()
def openai_client(proxy, key):
    import openai

    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _few_shot() -> tuple[list[dict], list[dict]]:
    """Three solved weather questions, then Paris: in Anthropic and in OpenAI form."""
    ant: list[dict] = []
    oai: list[dict] = []
    for i, city in enumerate(["Rome", "Berlin", "Madrid"]):
        ant += [{"role": "user", "content": f"What is the weather in {city}?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}",
                                                   "name": "get_weather",
                                                   "input": {"city": city}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                              "content": "sunny"}]},
                {"role": "assistant", "content": f"It is sunny in {city}."}]
        oai += [{"role": "user", "content": f"What is the weather in {city}?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": f"toolu_{i}", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                {"role": "tool", "tool_call_id": f"toolu_{i}", "name": "get_weather",
                 "content": "sunny"},
                {"role": "assistant", "content": f"It is sunny in {city}."}]
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    return [*ant, ask], [*oai, ask]


ASK, ASK_OPENAI = _few_shot()


def _prompt_tokens(u) -> int:
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_plain_message(client, openai_client):
    reply = client.messages.create(model="default", max_tokens=20, **GREEDY,
                                   messages=FRANCE)
    assert reply.type == "message" and reply.role == "assistant"
    assert reply.id.startswith("msg_")
    [block] = reply.content
    assert block.type == "text" and "Paris" in block.text
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    same = openai_client.chat.completions.create(model="default", messages=FRANCE,
                                                 **GREEDY, max_tokens=20)
    assert block.text == same.choices[0].message.content
    assert _prompt_tokens(reply.usage) == same.usage.prompt_tokens
    assert reply.usage.output_tokens == same.usage.completion_tokens


def test_same_conversation_through_both_apis_gives_the_same_greedy_tokens(
        client, openai_client):
    system = f"You are weather bot {uuid.uuid4().hex[:8]}. Answer in one short sentence."
    ant = client.messages.create(model="default", max_tokens=40, **GREEDY, system=system,
                                 tools=[WEATHER], tool_choice={"type": "none"}, messages=ASK)
    oai = openai_client.chat.completions.create(
        model="default", max_tokens=40, **GREEDY, tools=WEATHER_OPENAI, tool_choice="none",
        messages=[{"role": "system", "content": system}, *ASK_OPENAI])
    assert [b.type for b in ant.content] == ["text"]
    assert ant.content[0].text == oai.choices[0].message.content
    assert ant.usage.output_tokens == oai.usage.completion_tokens
    assert _prompt_tokens(ant.usage) == oai.usage.prompt_tokens
    # one set of anchors for both APIs: the system prompt is new to this test, so what the
    # chat completion restores was saved by the Anthropic request
    assert ant.usage.cache_read_input_tokens == 0
    assert oai.usage.prompt_tokens_details.cached_tokens > 0
    assert ant.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        oai.choices[0].finish_reason]
    counted = client.messages.count_tokens(model="default", system=system, tools=[WEATHER],
                                           messages=ASK)
    assert counted.input_tokens == oai.usage.prompt_tokens


def test_tool_use_round_trip(client):
    first = client.messages.create(model="default", max_tokens=40, **GREEDY,
                                   tools=[WEATHER], messages=ASK)
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_")
    follow = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                            "content": "rainy, 12 °C"}]}]
    second = client.messages.create(model="default", max_tokens=30, **GREEDY,
                                    tools=[WEATHER], tool_choice={"type": "none"},
                                    messages=follow)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"] and second.content[0].text
    # the second turn's prompt starts with the first turn's: restored, not prefilled again
    assert second.usage.cache_read_input_tokens > 0


def test_streamed_tool_use_equals_the_whole_reply(client):
    kw = dict(model="default", max_tokens=40, **GREEDY, tools=[WEATHER], messages=ASK,
              tool_choice={"type": "tool", "name": "get_weather"})
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type in (
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.type == "input_json_delta" for d in deltas)
    assert json.loads("".join(d.partial_json for d in deltas)) == {"city": "Paris"}
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == \
        [(b.type, b.name, b.input) for b in whole.content]
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert _prompt_tokens(final.usage) == _prompt_tokens(whole.usage)


def test_streamed_text_equals_the_whole_reply(client):
    kw = dict(model="default", max_tokens=48, **GREEDY, messages=[
        {"role": "user", "content": "Name three colors and say why you like them."}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 3 and "".join(pieces) == whole.content[0].text
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == \
        (whole.stop_reason, whole.usage.output_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_sequences_spanning_tokens(client, stream):
    base = client.messages.create(model="default", max_tokens=24, **GREEDY,
                                  messages=FRANCE).content[0].text
    words = base.split()
    # the end of one word, the space and the start of the next: never a single token
    stop = words[2][-1] + " " + words[3][:2]
    kw = dict(model="default", max_tokens=24, **GREEDY, messages=FRANCE,
              stop_sequences=["never-seen-xyz", stop])
    if stream:
        with client.messages.stream(**kw) as s:
            text = "".join(s.text_stream)
            reply = s.get_final_message()
    else:
        reply = client.messages.create(**kw)
        text = reply.content[0].text
    assert text == base[: base.index(stop)]
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop


def test_chat_completions_stream_never_leaks_part_of_a_stop_string(openai_client):
    """The pipeline holds back text a stop string may still complete: the OpenAI stream, too,
    stops exactly before a stop string that spans tokens and chunks."""
    kw = dict(model="default", max_tokens=24, temperature=0, messages=FRANCE)
    base = openai_client.chat.completions.create(**kw).choices[0].message.content
    words = base.split()
    stop = words[2][-1] + " " + words[3][:2]
    chunks = openai_client.chat.completions.create(stream=True, stop=[stop], **kw)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == base[: base.index(stop)]


def test_a_shared_cache_control_system_block_is_read_from_cache(client):
    system = [{"type": "text", "text": f"Session {uuid.uuid4().hex}. You answer geography "
               "questions briefly and precisely.", "cache_control": CC}]
    first = client.messages.create(model="default", max_tokens=8, **GREEDY,
                                   system=system, messages=FRANCE)
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation_input_tokens > 0
    second = client.messages.create(model="default", max_tokens=8, **GREEDY, system=system,
                                    messages=[{"role": "user",
                                               "content": "What is the capital of Italy?"}])
    assert second.usage.cache_read_input_tokens > 0
    assert _prompt_tokens(second.usage) > second.usage.cache_read_input_tokens


@pytest.fixture(scope="module")
def off_client(worker):
    """A second proxy on the same worker with anchors off: the reference outputs."""
    with proxy_in_process(worker.url, anchors=False) as off:
        yield anthropic.Anthropic(base_url=off.url, api_key=tenant_key(off, "reference"),
                                  max_retries=0, timeout=120)


def _history(marked: bool) -> list[dict]:
    mark = {"cache_control": CC} if marked else {}
    return [{"role": "user", "content": "Tell me about Rome."},
            {"role": "assistant", "content": "Rome is the capital of Italy."},
            {"role": "user", "content": [{"type": "text", "text": "And Berlin?", **mark}]}]


@pytest.mark.parametrize("marked", [True, False], ids=["marked", "unmarked"])
def test_cache_control_on_a_message_anchors_exactly_that_prefix(client, off_client,
                                                                  default_model_dir, marked):
    """Two requests share the first three messages and differ after them. Only a
    cache_control mark on the third message makes an anchor there, which the second
    request restores: exactly the template's tokens for the marked prefix, and the replies
    equal those of an anchors-off proxy."""
    system = f"Session {uuid.uuid4().hex}."
    head = _history(marked)
    a = [*head, {"role": "assistant", "content": "Berlin is the capital of Germany."},
         {"role": "user", "content": "And Paris?"}]
    b = [*head, {"role": "assistant", "content": "Berlin is in Germany."},
         {"role": "user", "content": "And Madrid?"}]
    replies = []
    for messages in (a, b):
        kw = dict(model="default", max_tokens=12, system=system, messages=messages, **GREEDY)
        on, off = client.messages.create(**kw), off_client.messages.create(**kw)
        # restoring the hinted anchor changes nothing: the same greedy tokens as anchors off
        assert on.content[0].text == off.content[0].text
        assert on.usage.output_tokens == off.usage.output_tokens
        replies.append(on)
    second = replies[1]
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    as_openai = [{"role": "system", "content": system},
                 *({"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                    else m["content"][0]["text"]} for m in head)]
    marked_prefix = len(tok.apply_chat_template(as_openai, add_generation_prompt=False)
                        ["input_ids"])
    instruction = len(tok.apply_chat_template(as_openai[:1])["input_ids"])
    expected = marked_prefix if marked else instruction
    assert second.usage.cache_read_input_tokens == expected


BAD = [
    ("not json", b"{nope", 400, "invalid_request_error"),
    ("missing max_tokens", {"model": "default", "messages": FRANCE}, 400,
     "invalid_request_error"),
    ("tool_result without tool_use", {"model": "default", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                      "content": "x"}]}]}, 400, "invalid_request_error"),
    ("image block", {"model": "default", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ("tool_use in a user message", {"model": "default", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                      "input": {}}]}]}, 400, "invalid_request_error"),
    ("bad cache_control", {"model": "default", "max_tokens": 8, "system": [
        {"type": "text", "text": "s", "cache_control": {"type": "forever"}}],
        "messages": FRANCE}, 400, "invalid_request_error"),
    ("unknown model", {"model": "claude-9", "max_tokens": 8, "messages": FRANCE}, 404,
     "not_found_error"),
    ("context overflow", {"model": "default", "max_tokens": 10, "messages": [
        {"role": "user", "content": "word " * 9000}]}, 400, "invalid_request_error"),
    ("body over the limit", {"model": "default", "max_tokens": 8, "messages": [
        {"role": "user", "content": "x" * 70000}]}, 413, "request_too_large"),
]


@pytest.mark.parametrize("name,body,status,kind", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_anthropic_error(proxy, name, body, status, kind):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(proxy.url + "/v1/messages", content=data, timeout=60,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    err = resp.json()
    assert err["type"] == "error" and err["error"]["type"] == kind
    assert isinstance(err["error"]["message"], str) and err["error"]["message"]
    assert httpx.get(proxy.url + "/health", timeout=30).status_code == 200


def test_wrong_method_and_unknown_path_are_anthropic_errors(proxy):
    resp = httpx.get(proxy.url + "/v1/messages", timeout=30)
    assert resp.status_code == 405
    assert resp.json()["error"]["type"] == "invalid_request_error"
    resp = httpx.post(proxy.url + "/v1/messages/nothing-here", json={}, timeout=30)
    assert resp.status_code == 404
    assert resp.json() == {"type": "error", "error": {"type": "not_found_error",
                                                      "message": "Not Found"}}


def test_the_sdk_raises_its_own_error_types(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="default", max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "text", "text": "x",
                                          "cache_control": {"type": "ephemeral", "ttl": "9y"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-9", max_tokens=8, messages=FRANCE)


COUNT = [{"role": "user", "content": "Count from 1 to 500, one number per line."}]


def _events(resp: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in resp.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def test_worker_failures_are_anthropic_errors(worker, proxy):
    body = {"model": "default", "max_tokens": 50, "temperature": 0, "messages": COUNT}
    # before any output: a status code and an error object
    httpx.post(worker.url + "/debug/fault", json={"where": "prefill"}).raise_for_status()
    resp = httpx.post(proxy.url + "/v1/messages", json=body, timeout=60)
    assert resp.status_code == 502
    assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "api_error"
    # after the first output: an in-band error event ends the stream
    httpx.post(worker.url + "/debug/fault", json={"where": "decode"}).raise_for_status()
    with httpx.stream("POST", proxy.url + "/v1/messages", json={**body, "stream": True},
                      timeout=60) as resp:
        assert resp.status_code == 200
        events = _events(resp)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "error"
    assert "message_stop" not in names
    assert events[-1][1]["type"] == "error" and events[-1][1]["error"]["type"] == "api_error"
    # and the worker is idle again: nothing of the failed requests lingers
    assert httpx.get(worker.url + "/health", timeout=10).json()["running_requests"] == []
