"""Parse and validate Anthropic Messages requests (`POST /v1/messages`) once, at the HTTP
edge, into the pipeline's `Generation`: the messages through `anthropic_messages`, and

- `tools` (`name`, `description`, `input_schema`) become function tools; `tool_choice`
  `auto`/`any`/`tool`/`none` becomes `auto`/`required`/a named function/`none`, and
  `disable_parallel_tool_use` the grammar's one call (`parallel_tool_calls: false`);
- `thinking` becomes the pipeline's `reasoning_effort` (splitter/reasoning.py turns it into
  the template's own switch): `disabled` or no `thinking` (Anthropic's default) "none",
  `enabled` / `adaptive` the `output_config.effort` (or the template's default);
- `output_config.format` (a JSON schema) becomes a `json_schema` response format;
- fields that concern Anthropic's service alone (`context_management`, `service_tier`,
  `container`, ...) are accepted and ignored, their types checked.

A top-level `cache_control` (automatic caching: the last block) asks for the end of the
messages, which the splitter cuts anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import orjson

from .anthropic_messages import Conversion, Resume, Turn, as_object, longest, message_turns
from .errors import ApiError
from .pipeline import Generation
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
    temperature,
)
from .splitter.memo import ConversionMemos as Memos
from .splitter.memo import Read
from .splitter.validate_tools import check_choice_name, check_function_tools
from .structured import ResponseFormat, check_schema

MAX_STOP_SEQUENCES = 64
THINKING_TYPES = frozenset({"enabled", "adaptive", "between_tools", "disabled"})
# Anthropic's `output_config.effort` as OpenAI's `reasoning_effort` (splitter/reasoning.py)
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
# top-level fields accepted for what they mean to Anthropic's service (containers, service
# tiers, server-side context edits, ...) and ignored here: only their type is checked
IGNORED_FIELDS: dict[str, tuple[type, ...]] = {
    "context_management": (dict,), "service_tier": (str,), "container": (str, dict),
    "inference_geo": (str,), "speed": (str,), "diagnostics": (dict,),
    "user_profile_id": (str,), "workspace_id": (str,)}


@dataclass(frozen=True)
class MessagesRequest:
    """An Anthropic request: the pipeline's `Generation`, plus what only Anthropic has."""

    model: str
    generation: Generation  # cache_control marks: its `cut_after` and `cut_ttl_s`
    stream: bool
    user_id: str | None  # metadata.user_id
    single_tool_use: bool  # tool_choice.disable_parallel_tool_use
    thinking: bool | None = None  # `thinking` asked for (True), disabled (False), not sent (None)
    omit_thinking: bool = False  # thinking.display "omitted": thinking blocks carry no text


def _tools(body: dict[str, Any], conv: Conversion) -> tuple[dict[str, Any], ...]:
    """Anthropic tools as OpenAI function tools; cache_control marks go to `conv`."""
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    if len(tools) > conv.limits.max_tools:
        raise bad(f"at most {conv.limits.max_tools} tools are supported", "tools")
    out, params = [], []
    for i, tool in enumerate(tools):
        p = f"tools.{i}"
        tool = as_object(tool, p)
        if tool.get("type", "custom") != "custom":
            raise bad(f"unsupported tool type {tool.get('type')!r}; only custom tools "
                       "(name, description, input_schema) are supported", f"{p}.type")
        if not isinstance(tool.get("input_schema"), dict):
            raise bad("each tool needs an object 'input_schema'", f"{p}.input_schema")
        fn: dict[str, Any] = {"name": tool.get("name")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": fn})
        params.append(p)
        conv.tools_hinted = longest(conv.tools_hinted, conv.mark(tool, p))
    check_function_tools(out, params=params, max_name_chars=conv.limits.max_name_chars,
                         error=bad)
    return tuple(out)


def _tool_choice(body: dict[str, Any], tools: tuple[dict[str, Any], ...]
                 ) -> tuple[ToolChoice, bool]:
    choice = body.get("tool_choice")
    if choice is None:
        return ToolChoice("auto" if tools else "none"), False
    choice = as_object(choice, "tool_choice")
    kind = choice.get("type")
    single = choice.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise bad("'disable_parallel_tool_use' must be a boolean",
                   "tool_choice.disable_parallel_tool_use")
    if kind == "none":
        return ToolChoice("none"), False
    if kind in ("any", "tool") and not tools:
        raise bad(f"tool_choice {kind!r} needs tools", "tool_choice")
    if kind == "auto":
        return ToolChoice("auto" if tools else "none"), single
    if kind == "any":
        return ToolChoice("required"), single
    if kind == "tool":
        name = check_choice_name(choice.get("name"), tools, param="tool_choice.name", error=bad)
        return ToolChoice("function", name), single
    raise bad("tool_choice.type must be 'auto', 'any', 'tool' or 'none'", "tool_choice.type")


def _stop_sequences(body: dict[str, Any], limits: BodyLimits) -> tuple[str, ...]:
    stops = body.get("stop_sequences")
    if stops is None:
        return ()
    if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES or \
            not all(isinstance(s, str) and 0 < len(s) <= limits.max_stop_chars for s in stops):
        raise bad(f"'stop_sequences' must be a list of up to {MAX_STOP_SEQUENCES} non-empty "
                  f"strings of at most {limits.max_stop_chars} characters", "stop_sequences")
    return tuple(stops)


def _user_id(body: dict[str, Any]) -> str | None:
    meta = body.get("metadata")
    if meta is None:
        return None
    user_id = as_object(meta, "metadata").get("user_id")
    if user_id is not None and not isinstance(user_id, str):
        raise bad("metadata.user_id must be a string", "metadata.user_id")
    return user_id


def _thinking(body: dict[str, Any]) -> tuple[bool | None, bool]:
    """`thinking`: asked for (True), disabled (False) or not sent (None), and whether its
    text is to be omitted (`display: "omitted"`). `budget_tokens` is checked (a positive
    integer; Anthropic's own floor of 1,024 and its bound by max_tokens are not enforced,
    nor is the budget: max_tokens bounds thinking and answer together)."""
    thinking = body.get("thinking")
    if thinking is None:
        return None, False
    thinking = as_object(thinking, "thinking")
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise bad(f"thinking.type must be one of {sorted(THINKING_TYPES)}", "thinking.type")
    budget = thinking.get("budget_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 1):
        raise bad("thinking.budget_tokens must be a positive integer", "thinking.budget_tokens")
    display = thinking.get("display")
    if display is not None and not isinstance(display, str):
        raise bad("thinking.display must be a string", "thinking.display")
    return kind != "disabled", display == "omitted"


def _output_config(body: dict[str, Any]) -> tuple[str | None, ResponseFormat | None]:
    """`output_config`: the effort as OpenAI's reasoning effort (None: not given, or a level
    not known here), and `format` (a JSON schema) as a response format."""
    config = body.get("output_config")
    if config is None:
        return None, None
    config = as_object(config, "output_config")
    effort = config.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad("output_config.effort must be a string", "output_config.effort")
    fmt = config.get("format")
    if fmt is None:
        return EFFORTS.get(effort or ""), None
    fmt = as_object(fmt, "output_config.format")
    if fmt.get("type") != "json_schema":
        raise bad("output_config.format.type must be 'json_schema'", "output_config.format.type")
    schema = check_schema(fmt.get("schema"), "output_config.format.schema")
    return EFFORTS.get(effort or ""), ResponseFormat("json_schema", schema, "output", True)


def _ignored_fields(body: dict[str, Any]) -> None:
    """Fields that have no meaning here: accepted, their types checked."""
    for name, types in IGNORED_FIELDS.items():
        if body.get(name) is not None and not isinstance(body[name], types):
            kinds = " or ".join("an object" if t is dict else "a string" for t in types)
            raise bad(f"'{name}' must be {kinds}", name)
    servers = body.get("mcp_servers")
    if servers is not None and servers != []:
        raise bad("MCP servers are not supported (the proxy runs no MCP client)",
                  "mcp_servers")


def _no_check(i: int, item: Any) -> None:
    """A message's own checks are the conversion's (`checked_items` holds it to the limits)."""


# a kept conversion state, the turns after it, and the tools' and system's bytes it was kept under
Resumed = tuple[Resume, list[Turn], bytes]


def _convert(conv: Conversion, body: dict[str, Any], limits: BodyLimits, memos: Memos | None,
             scope: bytes, head: bytes | None, base: int = 0,
             resumed: Resumed | None = None) -> tuple[bytes, int]:
    """`system` and `messages` through `conv`: the messages from index `base` on are
    `body["messages"]` (`resumed`: the kept state at `base`, those messages' turns and the
    tools' and system's bytes).
    With `memos` and `head` (the messages' JSON bytes less the closing bracket, or a
    body's own bytes up to their end: `Read.head`), from the caller's kept state where its
    messages extend a kept request's up to the start of that one's last turn (with the same
    tools and system); then the state before this request's last turn is kept. Equal to
    converting from nothing: a kept state was reached by this very conversion over the same
    bytes without an error, the turns after it start with another role (else the first
    would continue the kept one: converted from nothing), and no state is kept behind a
    system message that hides itself once a user message follows (`clear_at`): a later
    request could add that user message. (`head` up to the start of the last turn, as kept,
    and the messages before it; b"", 0 where none is kept.)"""
    messages: Any = body.get("messages")
    context = None
    turns: list[Turn] | None = None
    role = ""  # the role of the turn before the first of `turns`
    if resumed is not None:
        context = resumed[2]
    elif memos is not None and head is not None:
        context = orjson.dumps([body.get("tools"), body.get("system")])
        if not base:
            found = memos.turns.find(scope, context, head)
            if found is not None:
                got = message_turns(messages, limits, found[0])
                if got and got[0][0] != found[1].role:
                    resumed = found[1], got, context
    if resumed is not None:
        conv.resume(resumed[0])
        role, turns = resumed[0].role, resumed[1]
    else:
        assert not base, "messages before `base` are converted only by resuming"
        conv.system(body.get("system"))
        turns = message_turns(messages, limits)
    before = None
    for n, (turn_role, blocks, _) in enumerate(turns):
        if n == len(turns) - 1 and context is not None:
            before = conv.state(turns[n - 1][0] if n else role)
        conv.turn(turn_role, blocks)
    if turns[-1][0] == "assistant":
        raise bad("the last message must be a user message; a final assistant message "
                  "(a prefill) is not supported", f"messages.{base + len(messages) - 1}")
    if conv.pending:
        raise bad(conv.unanswered(), "messages")
    last = turns[-1][2]  # the first message of the last turn
    if memos is None or before is None or head is None or context is None or last <= base \
            or any(isinstance(m, dict) and "clear_at" in m for m in messages[:last - base]):
        return b"", 0
    tail = orjson.dumps(messages[last - base:])[1:-1]
    if not head.endswith(tail) or head[len(head) - len(tail) - 1:][:1] != b",":
        return b"", 0  # the client's bytes for the last turn are not orjson's: no key
    kept = head[:len(head) - len(tail) - 1]
    memos.turns.keep(scope, context, kept, last, before)
    return kept, last


def _resumable(read: Read, memos: Memos, scope: bytes, limits: BodyLimits
               ) -> Resumed | None:
    """For a body read through the memos from the start of a kept request's last turn on
    (`read.start`): the state kept there and the turns of the messages read, when the
    conversion may resume there (same tools and system, the first turn of another role);
    else None, and the body is decoded whole."""
    body = read.body
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return None
    try:
        context = orjson.dumps([body.get("tools"), body.get("system")])
        found = memos.turns.find(scope, context, read.raw)
        if found is None or found[0] != read.start:
            return None
        turns = message_turns(body["messages"], limits, read.start, base=read.start)
    except (ApiError, orjson.JSONEncodeError):
        return None  # the whole body's decode and checks say what is wrong
    return (found[1], turns, context) if turns and turns[0][0] != found[1].role else None


def parse_messages_request(body: Any, *, count_only: bool = False,
                           limits: BodyLimits = DEFAULT_LIMITS,
                           max_tokens_limit: int = MAX_TOKENS_LIMIT,
                           memos: Memos | None = None, scope: bytes = b"") -> MessagesRequest:
    """A `/v1/messages` body (or a `Read` of one, through `memos.shapes.read`);
    `count_only` for `/v1/messages/count_tokens`, which has no `max_tokens` (sampling fields
    are then ignored). A `max_tokens` beyond the context is the pipeline's to clamp
    (`--max-tokens-policy`). With `memos`, the messages the caller `scope` sent before are
    neither decoded, checked nor converted again: an agent resends its whole conversation
    with every turn, and the conversion resumes where the caller's last turn started
    (`_convert`), the body's bytes read from there on."""
    read = body if isinstance(body, Read) else None
    resumed = None
    if read is not None and read.start:
        resumed = _resumable(read, memos, scope, limits) if memos is not None else None
        if resumed is None:
            read = replace(read, body=orjson.loads(read.raw), start=0, prior=())
    base = read.start if read is not None else 0
    body, model, nodes = items_body(read.body if read is not None else body, "messages",
                                    limits)
    messages = body.get("messages")
    head: bytes | None = None
    shapes: list[Any] = []
    if isinstance(messages, list):
        if memos is not None:
            head = read.head if read is not None else orjson.dumps(messages)[:-1]
        checked_items(messages, nodes + base, limits, _no_check,
                      head=head if read is None else None,
                      # (no head: the memo keeps the list where the last turn starts, below)
                      read=replace(read, head=None) if read is not None else None,
                      memo=memos.shapes if memos is not None else None, scope=scope,
                      shapes=shapes)
    if body.get("max_tokens") is None and not count_only:
        raise bad("'max_tokens' is required", "max_tokens")
    max_tokens = None if count_only else optional_int(body, "max_tokens", 1, max_tokens_limit)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    thinking, omit_thinking = _thinking(body)
    effort, response_format = _output_config(body)
    _ignored_fields(body)
    conv = Conversion(limits)
    tools = _tools(body, conv)
    choice, single = _tool_choice(body, tools)
    kept, last = _convert(conv, body, limits, memos, scope, head, base, resumed)
    if kept and read is not None and memos is not None:  # the next turn is read from there
        memos.shapes.keep(scope, read, kept, shapes[:last])
    if body.get("cache_control") is not None:
        # automatic caching marks the last block: the end of the messages (cut anyway)
        conv.hint(len(conv.messages), conv.mark(body, ""))
    top_k = optional_int(body, "top_k", 0, 1 << 20)
    gen = Generation(
        messages=tuple(conv.messages),
        # (the memos' requests only: bytes of what is new since the turn they resumed from)
        messages_head=conv.head() if memos is not None else None,
        tools=tools,
        tool_choice=choice,
        max_tokens=max_tokens,
        temperature=temperature(body, hi=1.0),
        top_p=number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=top_k or -1,
        stop=_stop_sequences(body, limits),
        # no thinking, Anthropic's default, is "none" too: the template's switch turns it off
        reasoning_effort=effort if thinking else "none",
        cut_after=tuple(sorted(conv.hints)),
        cut_ttl_s=dict(conv.hints),
        response_format=response_format,
        parallel_tool_calls=not single,
    )
    return MessagesRequest(model, gen, stream, _user_id(body), single, thinking, omit_thinking)
