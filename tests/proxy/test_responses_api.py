"""`/v1/responses` end to end: the current openai SDK (`.venv/current-sdk`) against the real
proxy and the real embedded worker (SmolLM2), on the same anchors as chat completions;
and the ledger's stored responses on a real SQLite file."""

from __future__ import annotations

import json
import uuid

import httpx
import jsonschema
import pytest

from anchorcache.proxy.app import create_app
from anchorcache.proxy.config import ProxyConfig
from anchorcache.testing.sdk import run_client
from anchorcache.testing.servers import Server, tenant_key

pytestmark = pytest.mark.slow

# an enum keeps the forced call short and the small model's arguments deterministic
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Rome"]}},
               "required": ["city"], "additionalProperties": False}, "strict": True}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


# The SDK builds its objects without validation; its pydantic models, validating, hold every
# field it requires: a response with a reasoning item, a message and a call, every event.
STRICT = """
from pydantic import TypeAdapter
from openai.types.responses import Response, ResponseStreamEvent
from anchorcache.proxy.pipeline import Usage
from anchorcache.proxy.errors import ApiError
from anchorcache.proxy.responses_api import ItemFramer, _failure, _response
from anchorcache.proxy.responses_schema import parse_responses_request
from anchorcache.proxy.splitter.types import OutputDelta, ToolCallDelta
req = parse_responses_request({"model": "m", "input": "hi", "include": [
    "reasoning.encrypted_content"], "tools": [{"type": "function", "name": "f"},
                                               {"type": "web_search"}]})
framer = ItemFramer(encrypted_reasoning=True)
events = [{"type": "response.created", "response": _response(req, "m", "resp_1", 0)}]
for d in [OutputDelta(reasoning="r"), OutputDelta(content="a"),
          OutputDelta(tool_call=ToolCallDelta(0, "call_1", "f", "{}"))]:
    events += framer.feed(d)
events += framer.close()
usage = Usage(3, 2, 1, 2, 1, 0.0, 0.0, 0.0, ())
final = _response(req, "m", "resp_1", 0, status="completed", output=framer.items, usage=usage)
Response.model_validate(final)
failed = _response(req, "m", "resp_1", 0, status="failed", output=framer.items)
failed["error"] = _failure(ApiError("worker_error", "the worker failed"))
assert failed["error"]["code"] == "server_error"
Response.model_validate(failed)
events += [{"type": "response.completed", "response": final},
           {"type": "response.failed", "response": failed}]
adapter = TypeAdapter(ResponseStreamEvent)
for i, event in enumerate(events):
    adapter.validate_python({**event, "sequence_number": i})
out["validated"] = len(events)
"""


def _results(proxy: Server, key: str, script: str) -> dict:
    """Run `script` under the current SDK with `client` bound to `proxy`; it prints one line
    `RESULT <json>` (a dict `out`)."""
    head = f"""
import json, openai
client = openai.OpenAI(base_url="{proxy.url}/v1", api_key="{key}", max_retries=0, timeout=300)
out = {{}}
"""
    done = run_client(head + script + "\nprint('RESULT', json.dumps(out))\n")
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="module")
def key(proxy) -> str:
    return tenant_key(proxy, "responses-" + uuid.uuid4().hex[:8])


def test_the_current_sdk_creates_streams_and_structures_responses(proxy, key):
    out = _results(proxy, key, f"""
r = client.responses.create(model="default", input="Say hi.", instructions="Be brief.",
                            max_output_tokens=6, temperature=0, store=False)
out["plain"] = {{"id": r.id, "status": r.status, "text": r.output_text,
                 "types": [o.type for o in r.output], "usage": r.usage.model_dump(),
                 "incomplete": r.incomplete_details and r.incomplete_details.reason}}
events, text = [], ""
for e in client.responses.create(model="default", input="Say hi.", instructions="Be brief.",
                                 max_output_tokens=6, temperature=0, store=False, stream=True):
    events.append([e.type, e.sequence_number])
    if e.type == "response.output_text.delta":
        text += e.delta
    if e.type in ("response.completed", "response.incomplete"):
        final = e.response
out["stream"] = {{"events": events, "text": text, "final_text": final.output_text,
                  "status": final.status, "usage": final.usage.model_dump()}}
raw = client.responses.with_raw_response.create(
    model="default", input="Weather in Paris?", max_output_tokens=1, store=False,
    tools=[{{"type": "web_search"}}, {{"type": "code_interpreter", "container": {{"type": "auto"}}}}])
out["ignored"] = raw.headers.get("x-anchorcache-ignored-tools")
s = client.responses.create(model="default", input="Is the sky blue? Answer in JSON.",
                            max_output_tokens=24, temperature=0, store=False,
                            text={{"format": {{"type": "json_schema", "name": "answer",
                                             "schema": {ANSWER!r}, "strict": True}}}})
out["json"] = s.output_text
try:
    client.responses.create(model="default", input=[], max_output_tokens=2)
except openai.BadRequestError as e:
    out["bad"] = [e.status_code, e.body]
{STRICT}""")
    plain = out["plain"]
    assert plain["id"].startswith("resp_") and plain["types"] == ["message"] and plain["text"]
    assert plain["status"] in ("completed", "incomplete")
    if plain["status"] == "incomplete":
        assert plain["incomplete"] == "max_output_tokens"
    usage = plain["usage"]
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= 6
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}

    stream = out["stream"]
    types = [t for t, _ in stream["events"]]
    assert [n for _, n in stream["events"]] == list(range(len(types)))
    assert types[:6] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta", *types[4:5]]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{stream['status']}"]
    # greedy: the stream says what the reply said, and the final response holds it
    assert stream["text"] == stream["final_text"] == plain["text"]
    assert stream["usage"]["output_tokens"] == usage["output_tokens"]

    assert out["ignored"] == "web_search,code_interpreter"
    assert out["validated"] == 19
    jsonschema.validate(json.loads(out["json"]), ANSWER)
    status, body = out["bad"]
    assert status == 400 and body["type"] == "invalid_request_error" and body["param"] == "input"


def test_a_tool_round_trip_continued_by_previous_response_id_restores_the_first_turn(proxy, key):
    out = _results(proxy, key, f"""
tools = [{WEATHER!r}]
with client.responses.stream(model="default", input="What is the weather in Paris?",
                             instructions="Use the tools.", tools=tools,
                             tool_choice="required", parallel_tool_calls=False,
                             max_output_tokens=40,
                             temperature=0) as stream:
    first = stream.get_final_response()
call = [o for o in first.output if o.type == "function_call"][0]
out["first"] = {{"id": first.id, "status": first.status, "usage": first.usage.model_dump(),
                 "call": call.model_dump()}}
follow = [{{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}}]
second = client.responses.create(model="default", previous_response_id=first.id, tools=tools,
                                 instructions="Use the tools.", input=follow,
                                 tool_choice="none", max_output_tokens=4, temperature=0)
out["second"] = {{"usage": second.usage.model_dump(), "text": second.output_text,
                  "previous": second.previous_response_id}}
whole = [{{"role": "user", "content": "What is the weather in Paris?"}},
         *[o.model_dump(exclude_none=True) for o in first.output], *follow]
stateless = client.responses.create(model="default", input=whole, tools=tools, store=False,
                                    instructions="Use the tools.", tool_choice="none",
                                    max_output_tokens=4, temperature=0)
out["stateless"] = {{"usage": stateless.usage.model_dump(), "text": stateless.output_text}}
try:
    client.responses.create(model="default", previous_response_id=stateless.id, input="hi",
                            max_output_tokens=2)
except openai.NotFoundError as e:
    out["unstored"] = e.body["code"]
""")
    first, second, stateless = out["first"], out["second"], out["stateless"]
    assert first["status"] == "completed"
    call = first["call"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["status"] == "completed"
    # the continued turn renders the prompt the whole history renders, and restores the
    # first turn's anchors
    assert second["usage"]["input_tokens"] == stateless["usage"]["input_tokens"]
    assert second["text"] == stateless["text"] and second["previous"] == first["id"]
    prefix = first["usage"]["input_tokens"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= 0.9 * prefix, out
    assert out["unstored"] == "previous_response_not_found"  # store: false kept nothing


def test_a_tenant_continues_and_reads_only_its_own_responses(proxy):
    a, b = (tenant_key(proxy, f"resp-{t}-" + uuid.uuid4().hex[:6]) for t in "ab")

    def post(key: str, **body) -> httpx.Response:
        return httpx.post(proxy.url + "/v1/responses", timeout=300,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": "default", "max_output_tokens": 2, **body})

    first = post(a, input="Hello")
    assert first.status_code == 200, first.text
    rid = first.json()["id"]
    assert first.json()["store"] is True  # OpenAI's default
    assert first.headers["X-Anchorcache-Worker"]
    assert post(a, input="Again", previous_response_id=rid).status_code == 200
    theirs = post(b, input="Again", previous_response_id=rid)
    assert theirs.status_code == 404
    assert theirs.json()["error"] == {
        "message": f"Response with id '{rid}' not found.", "type": "invalid_request_error",
        "code": "previous_response_not_found", "param": "previous_response_id"}

    def call(method: str, key: str) -> httpx.Response:
        return httpx.request(method, f"{proxy.url}/v1/responses/{rid}", timeout=30,
                             headers={"Authorization": f"Bearer {key}"})

    assert call("GET", b).status_code == 404 and call("DELETE", b).status_code == 404
    got = call("GET", a)
    assert got.status_code == 200 and got.json()["output"] == first.json()["output"]
    assert call("DELETE", a).json() == {"id": rid, "object": "response", "deleted": True}
    assert call("GET", a).status_code == 404


def _sse(raw: str) -> list[dict]:
    events = []
    for block in raw.strip().split("\n\n"):
        head, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == "event: " + event["type"]
        events.append(event)
    return events


def test_a_codex_shaped_request_streams_a_call_statelessly(proxy):
    """What Codex sends: developer + user messages, function / namespace / web_search tools,
    store false, reasoning and include, a prompt_cache_key; then the next turn whole."""
    tools = [{"type": "function", "name": "shell", "description": "Run a command.",
              "strict": False, "parameters": {"type": "object", "properties": {
                  "command": {"type": "string", "enum": ["ls", "pwd"]}},
                  "required": ["command"], "additionalProperties": False}},
             {"type": "namespace", "name": "mcp__docs", "description": "Docs server.",
              "tools": [{"type": "function", "name": "search_docs", "parameters": {
                  "type": "object", "properties": {}}}]},
             {"type": "web_search", "external_web_access": False}]
    body = {"model": "default", "instructions": "You are a coding agent.", "store": False,
            "stream": True, "tools": tools, "tool_choice": "required",
            "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": str(uuid.uuid4()),
            "max_output_tokens": 40, "temperature": 0,
            "input": [{"type": "message", "role": "developer",
                       "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "List the files."}]}]}
    reply = httpx.post(proxy.url + "/v1/responses", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    assert reply.headers["X-Anchorcache-Ignored-Tools"] == "web_search"
    assert reply.headers["X-Anchorcache-Worker"]  # the pipeline's headers, once routed
    events = _sse(reply.text)
    done = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and done["store"] is False
    call = done["output"][-1]
    assert call["type"] == "function_call" and call["name"] in ("shell", "search_docs")
    assert call.get("namespace") == ("mcp__docs" if call["name"] == "search_docs" else None)
    body["input"] += [*done["output"], {"type": "function_call_output",
                                        "call_id": call["call_id"], "output": "README.md"}]
    body.update(tool_choice="auto", max_output_tokens=2)
    again = httpx.post(proxy.url + "/v1/responses", json=body, timeout=300)
    assert again.status_code == 200, again.text
    assert _sse(again.text)[-1]["type"] in ("response.completed", "response.incomplete")


async def test_a_conversation_past_the_body_limit_runs_only_unstored(aiohttp_client, worker, tmp_path):
    client = await aiohttp_client(create_app(ProxyConfig(
        worker_urls=(worker.url,), state_dir=str(tmp_path), max_body_bytes=1024)))
    body = {"model": "default", "max_output_tokens": 1, "input": "word " * 120}
    first = await client.post("/v1/responses", json=body)
    assert first.status == 200, await first.text()
    rid = (await first.json())["id"]
    second = await client.post("/v1/responses", json={**body, "previous_response_id": rid})
    assert second.status == 400
    assert (await second.json())["error"]["param"] == "store"
    stateless = await client.post("/v1/responses", json={
        **body, "previous_response_id": rid, "store": False})
    assert stateless.status == 200, await stateless.text()
