"""Parse and validate Anthropic Messages requests (`POST /v1/messages`) once, at the HTTP
edge, into the proxy's neutral chat form: OpenAI-style messages the splitter renders.

The mapping (consecutive messages of one role are one turn, as in Anthropic's API):
- `system` (a string or text blocks) becomes one leading system message;
- a user message's text blocks become a user message, each `tool_result` block a tool
  message (`tool_call_id` = its `tool_use_id`, `name` = the matching tool's name), in the
  order of the blocks;
- an assistant message's text blocks become its content, its `tool_use` blocks its
  `tool_calls` (`arguments` = the `input` object);
- `tools` (`name`, `description`, `input_schema`) become function tools; `tool_choice`
  `auto`/`any`/`tool`/`none` becomes `auto`/`required`/a named function/`none`.

Like Anthropic's API, every `tool_use` must be answered by a `tool_result` in the next
message and every `tool_result` must answer a `tool_use` of the message before it.

`cache_control: {"type": "ephemeral"}` marks an anchor hint: the end of the rendered message
holding the marked block (for `system` and `tools`: the end of the system part) becomes a
cut, verified by the splitter like every cut. A block inside a message that the template
merges with its neighbours (say, one of several tool results) hints at a boundary the
splitter cannot verify, and no cut is made there. A top-level `cache_control` (automatic
caching: the last block) asks for the end of the messages, which the splitter cuts anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .pipeline import Generation
from .schema import (
    DEFAULT_LIMITS,
    BodyLimits,
    ToolChoice,
    bad,
    check_shape,
    number,
    optional_int,
    string,
    temperature,
)

MAX_CACHE_BREAKPOINTS = 4  # what Anthropic's API accepts per request
MAX_STOP_SEQUENCES = 64
CACHE_TTLS = frozenset({"5m", "1h"})


@dataclass(frozen=True)
class MessagesRequest:
    """An Anthropic request: the pipeline's `Generation`, plus what only Anthropic has."""

    model: str
    generation: Generation  # cache_control marks: its `cut_after`
    stream: bool
    user_id: str | None  # metadata.user_id
    single_tool_use: bool  # tool_choice.disable_parallel_tool_use


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad("must be an object", param)
    return value


def _cache_control(block: dict[str, Any], param: str) -> bool:
    """Whether `block` carries a (valid) cache_control marker."""
    cc = block.get("cache_control")
    if cc is None:
        return False
    at = f"{param}.cache_control" if param else "cache_control"
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
        raise bad("cache_control must be {'type': 'ephemeral'}", at)
    ttl = cc.get("ttl")
    if ttl is not None and ttl not in CACHE_TTLS:
        raise bad(f"cache_control.ttl must be one of {sorted(CACHE_TTLS)}", f"{at}.ttl")
    if set(cc) - {"type", "ttl"}:
        raise bad(f"unknown cache_control fields {sorted(set(cc) - {'type', 'ttl'})}", at)
    return True


def _blocks(content: Any, param: str, *, allow_string: bool = True) -> list[dict[str, Any]]:
    """Content as a list of block objects (a string is one text block)."""
    if isinstance(content, str) and allow_string:
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad("content must be a string or a list of content blocks", param)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad("each content block must be an object with a 'type'", f"{param}.{j}")
    return content


def _join(texts: list[str]) -> str:
    """Text blocks of one message as one string, joined as the splitter joins text parts."""
    return "\n".join(texts)


def _text(block: dict[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad("a text block needs a string 'text'", f"{param}.text")
    return text


class _Conversion:
    """Walks the messages once, building OpenAI-style messages and the hinted cuts."""

    def __init__(self, limits: BodyLimits) -> None:
        self.limits = limits
        self.messages: list[dict[str, Any]] = []
        self.hints: set[int] = set()
        self.breakpoints = 0
        self.seen_ids: set[str] = set()
        self.pending: dict[str, str] = {}  # tool_use id → tool name, awaiting a tool_result
        self.tools_hinted = False

    def mark(self, block: dict[str, Any], param: str) -> bool:
        if not _cache_control(block, param):
            return False
        self.breakpoints += 1
        if self.breakpoints > MAX_CACHE_BREAKPOINTS:
            raise bad(f"at most {MAX_CACHE_BREAKPOINTS} blocks may carry cache_control",
                       param or "cache_control")
        return True

    def system(self, system: Any) -> None:
        """The system part; a marked tool or system block hints at its end (the tools render
        there or before it). Without system text there is no message to end: the
        splitter's instruction cut covers the tools on its own."""
        if system is None or system == "":
            return
        hinted = self.tools_hinted
        if isinstance(system, str):
            parts = [system]
        else:
            parts = []
            for j, block in enumerate(_blocks(system, "system", allow_string=False)):
                if block["type"] != "text":
                    raise bad(f"system blocks must be text blocks, not {block['type']!r}",
                               f"system.{j}")
                parts.append(_text(block, f"system.{j}"))
                hinted |= self.mark(block, f"system.{j}")
            if not parts:
                return
        self.messages.append({"role": "system", "content": _join(parts)})
        if hinted:
            self.hints.add(len(self.messages))

    def turn(self, role: str, blocks: list[tuple[dict[str, Any], str]]) -> None:
        """One turn: the blocks of consecutive messages of one role, with their params."""
        if self.pending and role != "user":
            raise bad(self.unanswered(), blocks[0][1].rsplit(".content", 1)[0])
        if role == "user":
            self._user(blocks)
        else:
            self._assistant(blocks)

    def unanswered(self) -> str:
        return ("tool_use ids were found without tool_result blocks immediately after: "
                + ", ".join(sorted(self.pending)))

    def _user(self, blocks: list[tuple[dict[str, Any], str]]) -> None:
        expected, self.pending = self.pending, {}
        answered: set[str] = set()
        texts: list[str] = []
        hint_text = False

        def flush_text() -> None:
            nonlocal texts, hint_text
            if texts:
                self.messages.append({"role": "user", "content": _join(texts)})
                if hint_text:
                    self.hints.add(len(self.messages))
            texts, hint_text = [], False

        for block, p in blocks:
            kind = block["type"]
            if kind == "text":
                texts.append(_text(block, p))
                hint_text |= self.mark(block, p)
            elif kind == "tool_result":
                flush_text()
                use_id = string(block.get("tool_use_id"), f"{p}.tool_use_id",
                                max_chars=self.limits.max_name_chars)
                if use_id not in expected:
                    raise bad(f"tool_result block with tool_use_id {use_id!r} has no matching "
                               "tool_use block in the previous message", f"{p}.tool_use_id")
                if use_id in answered:
                    raise bad(f"more than one tool_result for tool_use_id {use_id!r}",
                               f"{p}.tool_use_id")
                answered.add(use_id)
                is_error = block.get("is_error")
                if is_error is not None and not isinstance(is_error, bool):
                    raise bad("'is_error' must be a boolean", f"{p}.is_error")
                hinted = self.mark(block, p)
                parts, inner_hinted = self._result_parts(block, p)
                self.messages.append({"role": "tool", "tool_call_id": use_id,
                                      "name": expected[use_id], "content": _join(parts)})
                if hinted or inner_hinted:
                    self.hints.add(len(self.messages))
            elif kind == "tool_use":
                raise bad("tool_use blocks belong in assistant messages", f"{p}.type")
            else:
                raise bad(f"unsupported content block type {kind!r} in a user message "
                           "(supported: 'text', 'tool_result')", f"{p}.type")
        flush_text()
        if set(expected) - answered:
            self.pending = {k: v for k, v in expected.items() if k not in answered}
            raise bad(self.unanswered(), blocks[0][1].rsplit(".content", 1)[0])

    def _result_parts(self, block: dict[str, Any], param: str) -> tuple[list[str], bool]:
        """A tool_result's content as texts, and whether an inner block is marked."""
        content = block.get("content", "")
        if isinstance(content, str):
            return [content], False
        parts, hinted = [], False
        for k, inner in enumerate(_blocks(content, f"{param}.content", allow_string=False)):
            p = f"{param}.content.{k}"
            if inner["type"] != "text":
                raise bad(f"unsupported tool_result content block type {inner['type']!r} "
                           "(supported: 'text')", f"{p}.type")
            parts.append(_text(inner, p))
            hinted |= self.mark(inner, p)
        return parts, hinted

    def _assistant(self, blocks: list[tuple[dict[str, Any], str]]) -> None:
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        hinted = False
        for block, p in blocks:
            kind = block["type"]
            if kind == "text":
                texts.append(_text(block, p))
            elif kind == "tool_use":
                use_id = string(block.get("id"), f"{p}.id", max_chars=self.limits.max_name_chars)
                name = string(block.get("name"), f"{p}.name",
                              max_chars=self.limits.max_name_chars)
                args = block.get("input")
                if use_id in self.seen_ids:
                    raise bad(f"tool_use ids must be unique; {use_id!r} repeats", f"{p}.id")
                if not isinstance(args, dict):
                    raise bad("a tool_use block needs an object 'input'", f"{p}.input")
                self.seen_ids.add(use_id)
                self.pending[use_id] = name
                calls.append({"id": use_id, "type": "function",
                              "function": {"name": name, "arguments": args}})
            elif kind == "tool_result":
                raise bad("tool_result blocks belong in user messages", f"{p}.type")
            else:
                raise bad(f"unsupported content block type {kind!r} in an assistant message "
                           "(supported: 'text', 'tool_use')", f"{p}.type")
            hinted |= self.mark(block, p)
        out: dict[str, Any] = {"role": "assistant", "content": _join(texts) if texts else None}
        if calls:
            out["tool_calls"] = calls
        self.messages.append(out)
        if hinted:
            self.hints.add(len(self.messages))


def _turns(messages: Any, limits: BodyLimits
           ) -> list[tuple[str, list[tuple[dict[str, Any], str]]]]:
    """Messages as turns: consecutive messages of one role are one turn (as in Anthropic's
    API), each block paired with its param (`messages.3.content.1`)."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    if len(messages) > limits.max_messages:
        raise bad(f"at most {limits.max_messages} messages are supported", "messages")
    turns: list[tuple[str, list[tuple[dict[str, Any], str]]]] = []
    for i, msg in enumerate(messages):
        param = f"messages.{i}"
        msg = _object(msg, param)
        role = msg.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"role must be 'user' or 'assistant', not {role!r}", f"{param}.role")
        content = msg.get("content")
        if content is None or content == "" or content == []:
            raise bad("every message needs non-empty content", f"{param}.content")
        blocks = [(b, f"{param}.content.{j}")
                  for j, b in enumerate(_blocks(content, f"{param}.content"))]
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))
    return turns


def _tools(body: dict[str, Any], conv: _Conversion) -> tuple[dict[str, Any], ...]:
    """Anthropic tools as OpenAI function tools; cache_control marks go to `conv`."""
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    if len(tools) > conv.limits.max_tools:
        raise bad(f"at most {conv.limits.max_tools} tools are supported", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        p = f"tools.{i}"
        tool = _object(tool, p)
        if tool.get("type", "custom") != "custom":
            raise bad(f"unsupported tool type {tool.get('type')!r}; only custom tools "
                       "(name, description, input_schema) are supported", f"{p}.type")
        name = string(tool.get("name"), f"{p}.name", max_chars=conv.limits.max_name_chars)
        schema = tool.get("input_schema")
        if name in names:
            raise bad(f"tool names must be unique; {name!r} repeats", f"{p}.name")
        names.add(name)
        if not isinstance(schema, dict):
            raise bad("each tool needs an object 'input_schema'", f"{p}.input_schema")
        fn: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise bad("'description' must be a string", f"{p}.description")
            fn["description"] = tool["description"]
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
        conv.tools_hinted |= conv.mark(tool, p)
    return tuple(out)


def _tool_choice(body: dict[str, Any], tools: tuple[dict[str, Any], ...]
                 ) -> tuple[ToolChoice, bool]:
    choice = body.get("tool_choice")
    if choice is None:
        return ToolChoice("auto" if tools else "none"), False
    choice = _object(choice, "tool_choice")
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
        name = choice.get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise bad(f"tool_choice names an unknown tool {name!r}", "tool_choice.name")
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
    meta = _object(meta, "metadata")
    if set(meta) - {"user_id"}:
        raise bad(f"unknown metadata fields {sorted(set(meta) - {'user_id'})}", "metadata")
    user_id = meta.get("user_id")
    if user_id is not None and (not isinstance(user_id, str) or len(user_id) > 256):
        raise bad("metadata.user_id must be a string of at most 256 characters",
                   "metadata.user_id")
    return user_id


def parse_messages_request(body: Any, *, max_tokens_limit: int, count_only: bool = False,
                           limits: BodyLimits = DEFAULT_LIMITS) -> MessagesRequest:
    """A `/v1/messages` body; `count_only` for `/v1/messages/count_tokens`, which has no
    `max_tokens` (sampling fields are then ignored)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_shape(body, limits)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required", "model")
    if body.get("max_tokens") is None and not count_only:
        raise bad("'max_tokens' is required", "max_tokens")
    max_tokens = None if count_only else optional_int(body, "max_tokens", 1, max_tokens_limit)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        thinking = None
    if thinking is not None:
        raise bad("extended thinking is not supported by this model", "thinking")
    conv = _Conversion(limits)
    tools = _tools(body, conv)
    choice, single = _tool_choice(body, tools)
    conv.system(body.get("system"))
    turns = _turns(body.get("messages"), limits)
    for role, blocks in turns:
        conv.turn(role, blocks)
    if turns[-1][0] == "assistant":
        raise bad("the last message must be a user message; a final assistant message "
                   "(a prefill) is not supported", f"messages.{len(body['messages']) - 1}")
    if body.get("cache_control") is not None:
        # automatic caching marks the last block: the end of the messages, cut anyway
        conv.mark(body, "")
    top_k = optional_int(body, "top_k", 0, 1 << 20)
    gen = Generation(
        messages=tuple(conv.messages),
        tools=tools,
        tool_choice=choice,
        max_tokens=max_tokens,
        temperature=temperature(body, hi=1.0),
        top_p=number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=top_k or -1,
        stop=_stop_sequences(body, limits),
        cut_after=tuple(sorted(conv.hints)),
    )
    return MessagesRequest(model, gen, stream, _user_id(body), single)
