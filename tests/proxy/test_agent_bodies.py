"""Bodies as current agent CLIs send them: Claude Code 2.x on `/v1/messages?beta=true`
(beta headers, 24 tools, a system prompt in three blocks with `cache_control`, a system
message in the middle of `messages`, `thinking`, `output_config`, `context_management`,
`metadata`, `max_tokens` 32000) and opencode's Chat Completions (max_tokens above the
context), through the current SDKs (`.venv/current-sdk`) against the real proxy and worker;
and, without a server, what those bodies become: the max_tokens clamp, the Qwen3 render of
thinking and of a mid-conversation system message, the fold for a template that refuses
one (Mistral's)."""

from __future__ import annotations

import json
import uuid

import pytest
from typer.testing import CliRunner

from anchorcache.cli import app
from anchorcache.proxy.anthropic_messages import fold_system_messages
from anchorcache.proxy.anthropic_schema import parse_messages_request
from anchorcache.proxy.app import create_app
from anchorcache.proxy.config import ProxyConfig
from anchorcache.proxy.errors import ApiError
from anchorcache.proxy.pipeline import Generation, max_new_tokens
from anchorcache.proxy.running import STATE
from anchorcache.proxy.split_pool import SplitPool
from anchorcache.proxy.splitter import get_adapter
from anchorcache.proxy.splitter.reasoning import effort_template_kwargs
from anchorcache.proxy.splitter.tokenizers import load_tokenizer
from anchorcache.proxy.splitter.types import SplitError
from anchorcache.testing.adapters import template_input
from anchorcache.testing.sdk import run_client
from anchorcache.testing.servers import tenant_key

CLAUDE_CODE_TOOLS = [
    {"name": name, "description": f"The {name} tool.", "input_schema": {
        "type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"],
        "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}}
    for name in ["Task", "Bash", "Glob", "Grep", "ExitPlanMode", "Read", "Edit", "MultiEdit",
                 "Write", "NotebookEdit", "WebFetch", "TodoWrite", "WebSearch", "BashOutput",
                 "KillShell", "SlashCommand", "Skill", "AskUserQuestion", "ListMcpResources",
                 "ReadMcpResource", "EnterPlanMode", "TaskOutput", "LSP", "ToolSearch"]]
BETAS = "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27"
THINKING = {"enabled": {"type": "enabled", "budget_tokens": 31999},
            "adaptive": {"type": "adaptive"}, "disabled": {"type": "disabled"}}


def claude_code_body(session: str, thinking: str | None = "enabled") -> dict:
    """A Claude Code 2.x request body (its shape; shorter texts and tool schemas)."""
    body = {
        "model": "default", "max_tokens": 32000,
        "system": [
            {"type": "text", "text": f"You are Claude Code ({session}).",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Answer questions briefly."},
            {"type": "text", "text": "Working directory: /tmp/project",
             "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
            {"role": "system", "content": "<system-reminder>todo list empty</system-reminder>"},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?",
                                          "cache_control": {"type": "ephemeral"}}]}],
        "tools": CLAUDE_CODE_TOOLS,
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": f"user_{session}_account__session_{session}"},
    }
    if thinking is not None:
        body["thinking"] = THINKING[thinking]
    return body


# ---- without a server ------------------------------------------------------------------

def test_max_tokens_beyond_the_room_is_clamped_or_refused_by_policy():
    room = dict(default=1024, prompt_tokens=8000, context_tokens=8192)
    assert max_new_tokens(32000, policy="clamp", **room) == 192
    assert max_new_tokens(10**9, policy="clamp", **room) == 192
    assert max_new_tokens(100, policy="clamp", **room) == 100
    assert max_new_tokens(None, policy="clamp", **room) == 192  # the default, bounded too
    assert max_new_tokens(192, policy="refuse", **room) == 192
    with pytest.raises(ApiError) as e:
        max_new_tokens(193, policy="refuse", **room)
    assert e.value.kind == "context_length_exceeded" and e.value.status == 400
    for policy in ("clamp", "refuse"):  # no room at all: refused either way
        with pytest.raises(ApiError, match="exceeds the model's context"):
            max_new_tokens(1, policy=policy, default=1024, prompt_tokens=8192,
                           context_tokens=8192)


def test_the_max_tokens_policy_is_a_checked_option_of_proxy_and_serve():
    assert ProxyConfig().max_tokens_policy == "clamp"
    assert ProxyConfig(max_tokens_policy="refuse").max_tokens_policy == "refuse"
    with pytest.raises(ValueError, match="max_tokens_policy"):
        ProxyConfig(max_tokens_policy="sometimes")
    runner = CliRunner()
    for command in ("proxy", "serve"):
        flag = runner.invoke(app, [command, "--max-tokens-policy", "sometimes"])
        env = runner.invoke(app, [command], env={"ANCHORCACHE_MAX_TOKENS_POLICY": "sometimes"})
        for result in (flag, env):
            assert result.exit_code == 2 and "max_tokens_policy" in result.output, result.output


@pytest.fixture(scope="module")
def qwen3():
    tokenizer = load_tokenizer("qwen3")
    return tokenizer, get_adapter("auto", tokenizer)


def _render(tokenizer, adapter, gen: Generation) -> tuple[str, dict]:
    """The prompt the proxy sends for `gen` (kwargs merged as `Completion.create` does)."""
    kwargs = {**(effort_template_kwargs(adapter, gen.reasoning_effort)
                 if gen.reasoning_effort is not None else {}), **gen.template_kwargs}
    split = adapter.split([dict(m) for m in gen.messages], [dict(t) for t in gen.tools] or None,
                          template_kwargs=kwargs)
    return tokenizer.decode(list(split.input_ids)), kwargs


@pytest.mark.parametrize("thinking,on", [("enabled", True), ("adaptive", True),
                                         ("disabled", False), (None, False)])
def test_on_qwen3_thinking_switches_the_template_and_the_render_is_the_templates(
        qwen3, thinking, on):
    tokenizer, adapter = qwen3
    gen = parse_messages_request(claude_code_body("s", thinking)).generation
    text, kwargs = _render(tokenizer, adapter, gen)
    assert kwargs == ({} if on else {"enable_thinking": False})
    assert text.endswith("<|im_start|>assistant\n" if on else
                         "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the mid-conversation system message renders where it stands, as Qwen3's template does
    assert "<|im_start|>system\n<system-reminder>todo list empty</system-reminder><|im_end|>\n" \
        "<|im_start|>user\nWhat is the capital of France?" in text
    assert text == tokenizer.render(template_input(list(gen.messages)),
                                    [dict(t) for t in gen.tools], add_generation_prompt=True,
                                    **kwargs)


def test_thinking_sent_back_renders_as_qwen3s_template_renders_reasoning(qwen3):
    tokenizer, adapter = qwen3
    body = claude_code_body("s", "adaptive")
    body["messages"] += [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "The user wants files.", "signature": "abc"},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"arg": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "a.py"}]}]
    gen = parse_messages_request(body).generation
    text, kwargs = _render(tokenizer, adapter, gen)
    assert "<think>\nThe user wants files.\n</think>\n\n<tool_call>" in text
    assert text == tokenizer.render(template_input(list(gen.messages)),
                                    [dict(t) for t in gen.tools], add_generation_prompt=True,
                                    **kwargs)


def test_a_template_that_refuses_a_mid_conversation_system_message_gets_it_folded():
    adapter = get_adapter("auto", load_tokenizer("mistral"))
    gen = parse_messages_request(claude_code_body("s", None)).generation
    tools = [dict(t) for t in gen.tools]
    with pytest.raises(SplitError) as e:
        adapter.split([dict(m) for m in gen.messages], tools)
    assert e.value.param == "messages"  # what `anthropic_api._completion` retries on
    folded = fold_system_messages(gen)
    assert folded is not None and [m["role"] for m in folded.messages] == [
        "system", "user", "assistant", "user"]
    assert folded.messages[-1]["content"] == \
        "<system-reminder>todo list empty</system-reminder>\nWhat is the capital of France?"
    assert adapter.split([dict(m) for m in folded.messages], tools).input_ids


@pytest.mark.slow
async def test_the_proxy_folds_system_messages_for_a_template_that_refuses_them(
        aiohttp_client, worker, tmp_path):
    """`count_tokens` (which generates nothing) on a proxy whose splitter is Mistral's: the
    conversation is refused as sent, and counted folded."""
    client = await aiohttp_client(create_app(ProxyConfig(worker_urls=(worker.url,),
                                                         state_dir=str(tmp_path))))
    state = client.server.app[STATE]
    adapter = get_adapter("auto", load_tokenizer("mistral"))
    state.splits.close()
    state.adapter, state.splits = adapter, SplitPool(adapter)
    body = claude_code_body("s", "adaptive")
    del body["max_tokens"]
    resp = await client.post("/v1/messages/count_tokens?beta=true", json=body,
                             headers={"anthropic-beta": BETAS})
    assert resp.status == 200, await resp.text()
    folded = fold_system_messages(parse_messages_request(body, count_only=True).generation)
    assert folded is not None
    split = adapter.split([dict(m) for m in folded.messages], [dict(t) for t in folded.tools])
    assert await resp.json() == {"input_tokens": len(split.input_ids)}


# ---- the real proxy, the current SDKs ------------------------------------------------------

WEATHER_TOOLS = [{"name": name, "description": f"Current {what} in a city.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    for name, what in (("get_weather", "weather"), ("get_time", "time"))]
PARIS_ROME = [{"role": "user",
               "content": "What is the weather and the time in Paris and in Rome?"}]

CLIENT = """
import json, anthropic, openai
out = {}
claude = anthropic.Anthropic(base_url=URL, api_key=KEY, max_retries=0, timeout=600,
                             default_headers={"anthropic-beta": BETAS})
greedy = {"temperature": 0}
def create(body, **kw):
    raw = claude.beta.messages.with_raw_response.create(**body, **kw, extra_body=greedy)
    reply = raw.parse()
    return {"stop_reason": reply.stop_reason, "blocks": [b.type for b in reply.content],
            "text": "".join(b.text for b in reply.content if b.type == "text"),
            "tools": [[b.name, b.input] for b in reply.content if b.type == "tool_use"],
            "usage": reply.usage.model_dump(include={"input_tokens", "output_tokens",
                "cache_read_input_tokens", "cache_creation_input_tokens"}),
            "thinking_header": raw.headers.get("x-anchorcache-thinking"),
            "max_tokens_header": raw.headers.get("x-anchorcache-max-tokens")}
for name in ("enabled", "repeat"):
    out[name] = create(BODIES["enabled"])
out["disabled"] = create(BODIES["disabled"])
with claude.beta.messages.stream(**BODIES["adaptive"], extra_body=greedy) as stream:
    events = [e.type for e in stream]
    final = stream.get_final_message()
out["adaptive_stream"] = {"events": [events[0], events[-1]], "stop_reason": final.stop_reason,
                          "text": "".join(b.text for b in final.content if b.type == "text")}
counted = claude.beta.messages.count_tokens(**{k: v for k, v in BODIES["enabled"].items()
                                               if k not in ("max_tokens", "metadata")})
out["counted"] = counted.input_tokens
for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
    out["single_" + choice["type"]] = create(dict(
        model="default", max_tokens=60, tools=WEATHER_TOOLS, messages=PARIS_ROME,
        tool_choice={**choice, "disable_parallel_tool_use": True}))
chat = openai.OpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0, timeout=600)
raw = chat.chat.completions.with_raw_response.create(
    model="default", max_tokens=10**9, temperature=0,
    messages=[{"role": "user", "content": "What is the capital of France?"}])
reply = raw.parse()
out["opencode"] = {"finish_reason": reply.choices[0].finish_reason,
                   "prompt_tokens": reply.usage.prompt_tokens,
                   "max_tokens_header": raw.headers.get("x-anchorcache-max-tokens")}
reply = chat.chat.completions.create(
    model="default", max_tokens=60, temperature=0, parallel_tool_calls=False,
    tool_choice="required", messages=PARIS_ROME,
    tools=[{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                             "parameters": t["input_schema"]}}
           for t in WEATHER_TOOLS])
out["chat_single"] = {"finish_reason": reply.choices[0].finish_reason,
                      "calls": len(reply.choices[0].message.tool_calls or [])}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def replies(proxy) -> dict:
    """Every live check's replies, from one client process (one SDK import)."""
    session = uuid.uuid4().hex[:12]  # a system prompt new to the proxy: nothing cached yet
    bodies = {name: claude_code_body(session, name) for name in THINKING}
    header = (f"URL = {proxy.url!r}\nKEY = {tenant_key(proxy, 'agents-' + session)!r}\n"
              f"BETAS = {BETAS!r}\nBODIES = {bodies!r}\nWEATHER_TOOLS = {WEATHER_TOOLS!r}\n"
              f"PARIS_ROME = {PARIS_ROME!r}\n")
    done = run_client(header + CLIENT)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def _prompt_tokens(usage: dict) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + \
        usage["cache_creation_input_tokens"]


@pytest.mark.slow
def test_a_claude_code_body_is_served_with_max_tokens_clamped(replies):
    first = replies["enabled"]
    assert first["stop_reason"] == "end_turn" and "Paris" in first["text"]
    assert first["blocks"] == ["text"]  # SmolLM2 does not reason: no thinking block
    assert first["thinking_header"] == "unsupported"
    prompt = _prompt_tokens(first["usage"])
    assert replies["counted"] == prompt  # count_tokens (?beta=true) renders the same prompt
    assert int(first["max_tokens_header"]) == 8192 - prompt  # SmolLM2's context, less the prompt
    assert replies["disabled"]["thinking_header"] is None
    assert replies["disabled"]["text"] == first["text"]
    stream = replies["adaptive_stream"]
    assert stream["events"] == ["message_start", "message_stop"]
    assert (stream["stop_reason"], stream["text"]) == ("end_turn", first["text"])


@pytest.mark.slow
def test_cache_creation_counts_new_anchor_tokens_and_a_repeat_reads_them(replies):
    first, repeat = replies["enabled"]["usage"], replies["repeat"]["usage"]
    assert first["cache_read_input_tokens"] == 0 and first["cache_creation_input_tokens"] > 0
    assert repeat["cache_creation_input_tokens"] == 0
    assert repeat["cache_read_input_tokens"] >= first["cache_creation_input_tokens"] - 8
    assert _prompt_tokens(repeat) == _prompt_tokens(first)


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["any", "tool"])
def test_disable_parallel_tool_use_ends_the_turn_after_one_call(replies, choice):
    reply = replies["single_" + choice]
    assert reply["stop_reason"] == "tool_use" and reply["blocks"] == ["tool_use"]
    assert reply["usage"]["output_tokens"] < 60  # the grammar ended the output there


@pytest.mark.slow
def test_chat_completions_clamp_max_tokens_and_honour_parallel_tool_calls(replies):
    opencode = replies["opencode"]
    assert opencode["finish_reason"] == "stop"
    assert int(opencode["max_tokens_header"]) == 8192 - opencode["prompt_tokens"]
    assert replies["chat_single"] == {"finish_reason": "tool_calls", "calls": 1}
