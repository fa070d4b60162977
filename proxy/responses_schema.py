"""Parse and validate OpenAI Responses requests (`POST /v1/responses`) once, at the HTTP
edge, into the proxy's neutral chat form: OpenAI-style messages the splitter renders.

- `instructions` becomes one leading system message (it is never stored: a continued
  response uses the new request's instructions, as OpenAI's API does);
- `input` (a string: one user message, or a list of items) becomes canonical items and
  those chat messages (`responses_items.py`);
- `tools`: function tools (flat: `name`, `description`, `parameters`, `strict`) and the
  function tools inside `namespace` groups become function tools; every other tool type
  (hosted tools a local model cannot run) is left out of the prompt and named in
  `ignored_tools` (never a 400: Codex sends `web_search` with every request);
- `text.format` goes through the chat route's response-format parser (`structured.py`).

Nothing a client sends may reach the renderer in a shape that makes it raise: whatever is
not refused here with a 400 is safe downstream (tests/proxy/test_responses_fuzz.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ApiError
from .pipeline import Generation
from .responses_items import (
    Item,
    MessagesMemo,
    expect_object,
    parse_item,
    parse_items,
    to_messages,
)
from .schema import (
    DEFAULT_LIMITS,
    MAX_TOKENS_LIMIT,
    BodyLimits,
    ToolChoice,
    bad,
    checked_items,
    items_body,
    number,
    optional_int,
    string,
    temperature,
)
from .splitter.memo import MessageMemo, Read
from .splitter.reasoning import REASONING_EFFORTS
from .splitter.validate_tools import check_choice_name, check_function_tools
from .structured import ResponseFormat, parse_response_format

INCLUDE_REASONING = "reasoning.encrypted_content"
MAX_METADATA_KEYS = 16
MAX_ID_CHARS = 128


@dataclass(frozen=True)
class ResponsesRequest:
    model: str
    input_items: tuple[Item, ...]  # this request's items, canonical
    instructions: str | None
    tools: tuple[dict[str, Any], ...]  # chat-form function tools
    tool_choice: ToolChoice
    namespaces: dict[str, str]  # tool name → the namespace it came from
    ignored_tools: tuple[str, ...]  # tool types left out of the prompt, in order
    max_output_tokens: int | None
    temperature: float
    top_p: float
    response_format: ResponseFormat | None
    parallel_tool_calls: bool
    stream: bool
    store: bool
    previous_response_id: str | None
    encrypted_reasoning: bool  # include asks for reasoning.encrypted_content
    cache_salt: str | None
    reasoning_effort: str | None  # reasoning.effort, where the templates know it
    echo: dict[str, Any]  # what the response object repeats of the request

    def generation(self, history: tuple[Item, ...] = (), *, memo: MessagesMemo | None = None,
                   scope: bytes = b"") -> Generation:
        """The chat to complete: `history` (a stored conversation) then this input; with a
        `memo`, only the items after those the caller `scope` sent before are converted."""
        head = None
        if memo is not None and not history:
            messages, head = memo.convert(scope, self.input_items, self.instructions)
        else:
            messages = to_messages(history + self.input_items, self.instructions)
        return Generation(
            messages=tuple(messages), messages_head=head, tools=self.tools,
            tool_choice=self.tool_choice, max_tokens=self.max_output_tokens, temperature=self.temperature,
            top_p=self.top_p, cache_salt=self.cache_salt,
            response_format=self.response_format,
            parallel_tool_calls=self.parallel_tool_calls, reasoning_effort=self.reasoning_effort)


# ---- tools ---------------------------------------------------------------------------------

def _function(tool: dict[str, Any], param: str) -> dict[str, Any]:
    """A flat Responses function tool as a chat function tool (its keys in the client's
    order, as the chat route renders them); `check_function_tools` checks the rest."""
    if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
        raise bad("'strict' must be a boolean", f"{param}.strict")
    fn = {k: v for k, v in tool.items()
          if k in ("name", "description", "parameters", "strict") and v is not None}
    return {"type": "function", "function": fn}


def parse_tools(value: Any, limits: BodyLimits = DEFAULT_LIMITS
                ) -> tuple[tuple[dict[str, Any], ...], dict[str, str], tuple[str, ...]]:
    """(chat function tools, tool name → its namespace, ignored tool types)."""
    if value is None:
        return (), {}, ()
    if not isinstance(value, list):
        raise bad("'tools' must be a list", "tools")
    out: list[dict[str, Any]] = []
    params: list[str] = []
    namespaces: dict[str, str] = {}
    ignored: list[str] = []

    def add(tool: dict[str, Any], param: str, namespace: str | None) -> None:
        out.append(_function(tool, param))
        params.append(param)
        if namespace is not None:
            namespaces[str(tool.get("name"))] = namespace

    for i, tool in enumerate(value):
        p = f"tools[{i}]"
        kind = expect_object(tool, p).get("type")
        if not isinstance(kind, str):
            raise bad("each tool needs a 'type'", f"{p}.type")
        if kind == "function":
            add(tool, p, None)
        elif kind == "namespace":
            ns = string(tool.get("name"), f"{p}.name", max_chars=limits.max_name_chars)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise bad("a namespace needs a list of 'tools'", f"{p}.tools")
            for j, t in enumerate(inner):
                q = f"{p}.tools[{j}]"
                inner_kind = expect_object(t, q).get("type")
                if inner_kind == "function":
                    add(t, q, ns)
                elif isinstance(inner_kind, str):
                    ignored.append(inner_kind)
                else:
                    raise bad("each tool needs a 'type'", f"{q}.type")
        else:
            ignored.append(kind)
        if len(out) > limits.max_tools:
            raise bad(f"at most {limits.max_tools} tools are supported", "tools")
    check_function_tools(out, params=params, max_name_chars=limits.max_name_chars, error=bad)
    return tuple(out), namespaces, tuple(dict.fromkeys(ignored))


def parse_tool_choice(value: Any, tools: tuple[dict[str, Any], ...]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise bad("tool_choice 'required' needs function tools", "tool_choice")
        return ToolChoice(value if tools else "none")
    if isinstance(value, dict) and value.get("type") == "function":
        return ToolChoice("function", check_choice_name(value.get("name"), tools,
                                                        param="tool_choice.name", error=bad))
    if isinstance(value, dict) and value.get("type") == "allowed_tools" \
            and value.get("mode") in ("auto", "required"):
        return parse_tool_choice(value["mode"], tools)
    raise bad("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
              "'name': ...}; hosted tools cannot be forced here", "tool_choice")


# ---- the request ---------------------------------------------------------------------------

def _text_format(value: Any) -> ResponseFormat | None:
    """`text.format` through the chat route's response_format parser."""
    text = expect_object(value, "text") if value is not None else {}
    fmt = text.get("format")
    if fmt is None:
        return None
    fmt = expect_object(fmt, "text.format")
    chat = fmt
    if fmt.get("type") == "json_schema":
        chat = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    try:
        return parse_response_format(chat)
    except ApiError as e:
        raise bad(e.message.replace("response_format", "text.format")
                  .replace(".json_schema", ""), "text.format") from None


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean", name)
    return value


def _optional_string(body: dict[str, Any], name: str, max_chars: int) -> str | None:
    value = body.get(name)
    return None if value is None else string(value, name, max_chars=max_chars)


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    meta = body.get("metadata")
    if meta is None:
        return {}
    meta = expect_object(meta, "metadata")
    if len(meta) > MAX_METADATA_KEYS or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in meta.items()):
        raise bad(f"metadata holds at most {MAX_METADATA_KEYS} string values (keys of up to "
                  "64 characters, values of up to 512)", "metadata")
    return meta


def _effort(body: dict[str, Any]) -> str | None:
    """`reasoning.effort` where the templates know it (splitter/reasoning.py); efforts of
    OpenAI's own models only (`xhigh`, ...) are ignored, as the rest of `reasoning` is."""
    reasoning = body.get("reasoning")
    effort = None if reasoning is None else expect_object(reasoning, "reasoning").get("effort")
    if effort is None or effort in REASONING_EFFORTS:
        return effort
    if isinstance(effort, str):
        return None
    raise bad("'reasoning.effort' must be a string", "reasoning.effort")


def _include(body: dict[str, Any]) -> tuple[str, ...]:
    include = body.get("include")
    if include is None:
        return ()
    if not isinstance(include, list) or not all(isinstance(s, str) for s in include):
        raise bad("'include' must be a list of strings", "include")
    return tuple(include)


def parse_responses_request(body: Any, *, max_tokens_limit: int = MAX_TOKENS_LIMIT,
                            limits: BodyLimits = DEFAULT_LIMITS, memo: MessageMemo | None = None,
                            scope: bytes = b"") -> ResponsesRequest:
    """A `/v1/responses` body. Fields that only matter to OpenAI's service (`store`d
    retention, `service_tier`, `safety_identifier`, `prompt_cache_key`, `reasoning`,
    `truncation`, ...) are accepted and, beyond a type check, ignored. A
    `max_output_tokens` beyond what the context leaves is the pipeline's to clamp or refuse.
    With a `memo`, input items the caller `scope` sent before are not checked again (an
    agent that keeps its own history resends it whole each turn: splitter/memo.py); the
    body may be a `Read` through it (`MessageMemo.read`: those items not decoded again)."""
    read = body if isinstance(body, Read) else None
    start = read.start if read is not None else 0  # items decoded and checked before
    body, model, nodes = items_body(read.body if read is not None else body, "input", limits)
    if "input" not in body:
        raise bad("'input' is required", "input")
    value = body["input"]
    if isinstance(value, list):
        if start + len(value) > limits.max_messages:
            raise bad(f"at most {limits.max_messages} input items are supported", "input")
        items = tuple(i for i in checked_items(
            value, nodes + start, limits, lambda n, v: parse_item(v, f"input[{n}]", limits),
            memo=memo, scope=scope, read=read) if i is not None)
    else:
        items = parse_items(value, "input", limits)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("'instructions' must be a string", "instructions")
    tools, namespaces, ignored = parse_tools(body.get("tools"), limits)
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    if _flag(body, "background", False):
        raise bad("background responses are not supported", "background")
    for unsupported in ("conversation", "prompt"):
        if body.get(unsupported) is not None:
            raise bad(f"'{unsupported}' is not supported by this proxy", unsupported)
    for name in ("prompt_cache_key", "user", "safety_identifier", "service_tier",
                 "prompt_cache_retention", "truncation"):
        _optional_string(body, name, 512)
    if body.get("stream_options") is not None:
        expect_object(body["stream_options"], "stream_options")
    optional_int(body, "top_logprobs", 0, 20)
    optional_int(body, "max_tool_calls", 1, 1 << 20)
    previous = _optional_string(body, "previous_response_id", MAX_ID_CHARS)
    include = _include(body)
    max_output_tokens = optional_int(body, "max_output_tokens", 1, max_tokens_limit)
    parallel = _flag(body, "parallel_tool_calls", True)
    store = _flag(body, "store", True)
    text = body.get("text")
    temp, top_p = temperature(body), number(body, "top_p", 1.0, 1e-9, 1.0)
    echo = {
        "instructions": instructions, "max_output_tokens": max_output_tokens,
        "metadata": _metadata(body), "parallel_tool_calls": parallel,
        "previous_response_id": previous, "store": store,
        "temperature": temp, "top_p": top_p,
        "text": text if text is not None else {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
        "prompt_cache_key": body.get("prompt_cache_key"), "user": body.get("user"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "truncation": body.get("truncation") or "disabled",
    }
    return ResponsesRequest(
        model=model, input_items=items, instructions=instructions, tools=tools,
        tool_choice=choice, namespaces=namespaces, ignored_tools=ignored,
        max_output_tokens=max_output_tokens, temperature=temp, top_p=top_p,
        response_format=_text_format(text),
        parallel_tool_calls=parallel, stream=_flag(body, "stream", False), store=store,
        previous_response_id=previous, encrypted_reasoning=INCLUDE_REASONING in include,
        cache_salt=body.get("cache_salt"), reasoning_effort=_effort(body), echo=echo)
