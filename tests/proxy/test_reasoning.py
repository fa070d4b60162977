"""Reasoning output through the choice's text path and the OpenAI layer.

`Choice` with the real Qwen3 tokenizer: `Outcome.reasoning` is the reasoning deltas joined,
`Outcome.text` holds none of it, token counts are the worker's. End to end: a real proxy in
front of the embedded worker with the tiny random Qwen3 (the real tokenizer and template):
its output is steered into a think block by a grammar, and `reasoning_content` /
`content` must be exactly the split of the tokens it generated (read back from logprobs),
streamed or not; thinking switched off (`enable_thinking`, `reasoning_effort`) changes the
prompt as the template does; a tool call after the block parses and, sent back with its
reasoning, hits the reply's response anchor.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from anchorcache.proxy.choice import Choice, FinishReason, Outcome
from anchorcache.proxy.errors import ApiError
from anchorcache.proxy.schema import parse_chat_request
from anchorcache.proxy.splitter import get_adapter
from anchorcache.proxy.splitter.reasoning import response_parser
from anchorcache.proxy.splitter.tokenizers import load_tokenizer
from anchorcache.proxy.worker_client import Chunk
from anchorcache.testing.inprocess import proxy_in_process
from anchorcache.testing.servers import Endpoint, worker_process
from anchorcache.wire import AnchorReport, FinishAbort, FinishLength, FinishStop, GenerateMeta

USER = [{"role": "user", "content": "Weather in Rome?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}]
THINK = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){2,5}\n</think>\n\n[a-z]{2,8}( [a-z]{2,8}){0,3}"
# words the tiny model writes in the tokenizer's own tokens (its reply is what the template
# renders back, token for token), then "!" and a long tail that the stop sequence "!" cuts
# off while the worker still generates it
ANSWER = (r"<think>\n(The|A) (user|city) (is|was) (Rome|Paris|here)\.\n</think>\n\n"
          r"(It|Sunny) (is|was) (sunny|warm)!( [a-z]{2,8}){40,60}")


@pytest.fixture(scope="module")
def qwen3() -> Any:
    return get_adapter("auto", load_tokenizer("qwen3"))


def _meta(n: int, finish: str) -> GenerateMeta:
    reason = FinishStop() if finish == "stop" else FinishLength(n) if finish == "length" \
        else FinishAbort()
    return GenerateMeta(epoch="e", prompt_tokens=10, completion_tokens=n, cached_tokens=0,
                        prefill_tokens=10, finish_reason=reason, anchors=AnchorReport(),
                        restore_ms=0.0, prefill_ms=0.0, decode_ms=0.0)


def _run_choice(adapter: Any, text: str, *, finish: str = "stop", end: bool = True,
                tools: list[dict] | None = None) -> tuple[Outcome, list[Any], int]:
    tok = adapter.tokenizer
    ids = tok.encode(text) + ([tok.token_to_id("<|im_end|>")] if end else [])
    outcome = Outcome()
    choice = Choice(0, outcome, tokenizer=tok, parser=response_parser(adapter, tools),
                    stop=(), stop_ids=set(adapter.stop_token_ids), markers=("<tool_call>",))
    deltas = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        deltas += [p.delta for p in choice.feed(Chunk((t,), _meta(len(ids), finish) if last
                                                      else None)) if p.delta is not None]
    return outcome, deltas, len(ids)


def test_the_outcome_is_the_deltas_joined(qwen3):
    text = ('<think>\nRome, so <tool_call> is fine here.\n</think>\n\nSunny.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    outcome, deltas, n = _run_choice(qwen3, text, tools=TOOLS)
    assert outcome.reasoning == "Rome, so <tool_call> is fine here." == "".join(
        d.reasoning for d in deltas if d.reasoning is not None)
    assert outcome.text == "Sunny." == "".join(d.content for d in deltas if d.content)
    assert [c.name for c in outcome.tool_calls] == ["get_weather"]
    assert outcome.tool_call_error is None  # a marker in reasoning is no unparsed call
    assert outcome.completion_tokens == n and outcome.finish_reason is FinishReason.TOOL_CALLS


def test_cut_inside_the_block_is_reasoning_with_finish_length(qwen3):
    outcome, deltas, n = _run_choice(qwen3, "<think>\nStill thinking about", finish="length",
                                     end=False)
    assert outcome.reasoning == "Still thinking about" and outcome.text == ""
    assert "".join(d.reasoning for d in deltas) == outcome.reasoning
    assert outcome.finish_reason is FinishReason.LENGTH and outcome.completion_tokens == n


def test_reasoning_effort_is_validated():
    def parse(effort: Any) -> Any:
        return parse_chat_request({"model": "m", "messages": USER, "reasoning_effort": effort}
                                  ).reasoning_effort

    assert parse("low") == "low" and parse(None) is None
    for bad in ("max", 3, ""):
        with pytest.raises(ApiError) as e:
            parse(bad)
        assert e.value.param == "reasoning_effort" and e.value.kind == "invalid_request"


# -- end to end -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tiny_qwen3: Path) -> Iterator[Endpoint]:
    """The tiny Qwen3 (a model of its own: a worker of its own) behind a proxy."""
    with worker_process(model=str(tiny_qwen3)) as worker, proxy_in_process(worker.url) as proxy:
        yield proxy


def _post(proxy: Endpoint, **body: Any) -> dict[str, Any]:
    body = {"model": "default", "messages": USER, "temperature": 0, "max_tokens": 48, **body}
    resp = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stream(proxy: Endpoint, **body: Any) -> list[dict[str, Any]]:
    body = {"model": "default", "messages": USER, "temperature": 0, "max_tokens": 48,
            "stream": True, "stream_options": {"include_usage": True}, **body}
    events = []
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def _raw(reply: dict[str, Any]) -> str:
    """The text of every token the worker generated (logprobs; stop tokens excluded)."""
    return "".join(e["token"] for e in reply["choices"][0]["logprobs"]["content"])


def _template_split(raw: str) -> tuple[str, str]:
    """(reasoning, content) of an output that opens a think block, as the Qwen3 template
    reads them back (`reasoning_content.strip("\\n")`, `content.lstrip("\\n")`)."""
    assert raw.startswith("<think>")
    reasoning, _, content = raw.removeprefix("<think>").partition("</think>")
    return reasoning.strip("\n"), content.lstrip("\n")


@pytest.mark.slow
def test_the_think_block_is_reasoning_content(stack):
    reply = _post(stack, regex=THINK, logprobs=True)
    reasoning, content = _template_split(_raw(reply))
    message = reply["choices"][0]["message"]
    assert len(reasoning.split()) >= 3 and content
    assert message["reasoning_content"] == reasoning and message["content"] == content
    assert reply["choices"][0]["finish_reason"] == "stop"
    events = _stream(stack, regex=THINK, logprobs=True)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert all(not ("reasoning_content" in d and d.get("content")) for d in deltas)
    streamed_reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    assert "".join(streamed_reasoning) == reasoning and len(streamed_reasoning) >= 3
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert events[-1]["usage"]["completion_tokens"] == reply["usage"]["completion_tokens"]


@pytest.mark.slow
def test_cut_inside_the_block(stack):
    reply = _post(stack, regex=THINK, logprobs=True, max_tokens=4)
    raw = _raw(reply)
    assert "</think>" not in raw
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert choice["message"]["reasoning_content"] == raw.removeprefix("<think>").strip("\n")
    assert reply["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_thinking_off_is_the_templates_empty_block(stack, qwen3):
    on = _post(stack, max_tokens=2)["usage"]["prompt_tokens"]
    assert on == len(qwen3.split(USER).input_ids)
    off = _post(stack, regex=THINK, logprobs=True, chat_template_kwargs={"enable_thinking": False})
    assert off["usage"]["prompt_tokens"] == len(
        qwen3.split(USER, template_kwargs={"enable_thinking": False}).input_ids) == on + 4
    # the template closed the block: what follows is the answer, whatever it says
    assert "reasoning_content" not in off["choices"][0]["message"]
    assert off["choices"][0]["message"]["content"] == _raw(off)
    for effort, tokens in (("none", on + 4), ("minimal", on + 4), ("high", on)):
        assert _post(stack, max_tokens=2, reasoning_effort=effort)["usage"]["prompt_tokens"] == tokens
    kept = _post(stack, max_tokens=2, reasoning_effort="none",
                 chat_template_kwargs={"enable_thinking": True})
    assert kept["usage"]["prompt_tokens"] == on  # the template's own switch wins
    bad = httpx.post(stack.url + "/v1/chat/completions", timeout=60, json={
        "model": "default", "messages": USER, "reasoning_effort": "max"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


@pytest.mark.slow
def test_a_reply_sent_back_with_its_reasoning_hits_the_response_anchor(stack, qwen3):
    # a stop sequence ends the reply: its response anchor is the prompt and every token
    # before the stop (whichever stop token the random model would have ended with)
    reply = _post(stack, regex=ANSWER, stop=["!"], logprobs=True, max_tokens=90)
    message = reply["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "It is sunny",
                       "reasoning_content": "A user was here."}
    kept = "<think>\nA user was here.\n</think>\n\nIt is sunny"
    assert _raw(reply).startswith(kept + "!")
    prompt = qwen3.split(USER).input_ids
    generated = (*prompt, *qwen3.tokenizer.encode(kept))
    # a tool result next: the template keeps the reply's reasoning (it drops it once a new
    # user query follows, rewriting history: no response anchor can hit then)
    follow = [*USER, message, {"role": "tool", "tool_call_id": "x", "content": "18C"}]
    assert qwen3.split(follow).input_ids[: len(generated)] == generated
    again = _post(stack, messages=follow, max_tokens=2)
    assert again["usage"]["timings"]["anchor_hits"][-1] == {"kind": "response",
                                                            "depth": len(generated)}
    # without its reasoning the reply renders otherwise: no anchor past the prompt
    bare = {k: v for k, v in message.items() if k != "reasoning_content"}
    other = _post(stack, messages=[*follow[:1], bare, follow[2]], max_tokens=2)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] <= len(prompt)
