"""Parse and validate request bodies once, at the HTTP edge, into typed records.

Two layers, so that the Anthropic route can reuse the first:
- protocol-neutral pieces: `read_json`; `check_shape` walks the decoded body once,
  iteratively, against `BodyLimits` (nesting depth, node count), and `check_arguments` holds
  tool-call arguments sent as JSON strings to the same limits; the typed field readers
  (`number`, `optional_int`, `temperature`, `string`, `reasoning_effort`) raise
  `ApiError("invalid_request")` with the offending parameter;
- `parse_chat_request`: an OpenAI chat body → `ChatRequest`.

Nothing a client sends may reach the renderer, the tokenizer or the sampler in a shape that
makes them raise: whatever is not refused here must be safe downstream (the fuzz test in
tests/proxy/test_schema_fuzz.py holds this to zero 5xx).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from aiohttp import web

from anchorcache.wire import GREEDY_TEMPERATURE

from .errors import ApiError
from .splitter.memo import MessageMemo, Read
from .splitter.partial_json import close_json
from .splitter.reasoning import REASONING_EFFORTS
from .splitter.validate_tools import check_choice_name, check_function_tools
from .structured import Constraint, ResponseFormat, parse_grammar, parse_response_format

T = TypeVar("T")
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
ALWAYS_RENDERED_ROLES = frozenset({"system", "developer", "user", "tool"})
MAX_STOP_STRINGS = 4
MAX_CHOICES = 16  # n (the worker contract's limit)
MAX_TOP_LOGPROBS = 20
# The largest `max_tokens` a body may carry (a 64-bit integer): up to it, one beyond what
# the context leaves is the pipeline's to clamp or refuse (`ProxyConfig.max_tokens_policy`)
MAX_TOKENS_LIMIT = (1 << 63) - 1
# Names the renderer passes to chat templates itself: a client's template kwarg may not shadow them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token",
                                      "eos_token", "unk_token", "pad_token"})


@dataclass(frozen=True)
class BodyLimits:
    """Bounds on a request body beyond its byte size (`ProxyConfig.max_body_bytes`)."""

    max_depth: int = 64  # nested objects/arrays, counted from the body; agent tool schemas use < 15
    max_nodes: int = 250_000  # objects, arrays and scalars in the body
    max_messages: int = 10_000
    max_tools: int = 1_024
    max_name_chars: int = 256  # function names, tool-call ids
    max_stop_chars: int = 1_024


DEFAULT_LIMITS = BodyLimits()


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError("invalid_request", message, param=param)


# ---- protocol-neutral pieces ---------------------------------------------------------------

BODY_BYTES = web.RequestKey("body_bytes", int)  # the decoded body's length (read_json)


async def read_json(request: web.Request, decode: Callable[[bytes], Any] = orjson.loads
                    ) -> Any:
    """The decoded JSON body (its length in `request[BODY_BYTES]`; `decode`: orjson's, or
    one that raises its error). Unreadable bodies (a gzip label on plain bytes) are turned
    into 400s by the error middleware, bodies over the size limit into 413s."""
    raw = await request.read()
    request[BODY_BYTES] = len(raw)
    try:
        return decode(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError("invalid_json", f"the request body is not valid JSON: {e}") from None


async def read_items(request: web.Request, memo: MessageMemo, scope: bytes, key: str) -> Read:
    """`read_json` through `memo.read`: the items of the body's list `key` that extend one
    `scope` sent before are not decoded again (splitter/memo.py)."""
    read: Read = await read_json(request, lambda raw: memo.read(scope, raw, key))
    return read


def check_shape(body: Any, limits: BodyLimits = DEFAULT_LIMITS, *, depth: int = 1,
                defer: Any = None) -> int:
    """One iterative walk over a decoded JSON value at nesting level `depth` of the body:
    refuses nesting deeper than `limits.max_depth` and more than `limits.max_nodes` values.
    Never recurses, so no body can exhaust the stack here (nor, once accepted, downstream).
    The values counted; `defer`, a list inside `body`, is counted but its items are left to
    the caller (`checked_items`)."""
    stack: list[tuple[Any, int]] = [(body, depth)]
    nodes = 1
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if level > limits.max_depth:
            raise bad(f"the request body is nested deeper than {limits.max_depth} levels")
        nodes += len(value)  # counted before iterating: a flat array of millions stops here
        if nodes > limits.max_nodes:
            raise bad(f"the request body has more than {limits.max_nodes} JSON values")
        if value is not defer:
            stack.extend((child, level + 1) for child in children
                         if isinstance(child, (dict, list)))
    return nodes


ITEM_DEPTH = 3  # body → messages (or input) → item
_first, _second = operator.itemgetter(0), operator.itemgetter(1)


def checked_items(items: list[Any], nodes: int, limits: BodyLimits,
                  check: Callable[[int, Any], T], *, memo: MessageMemo | None = None,
                  scope: bytes = b"", head: bytes | None = None,
                  read: Read | None = None, shapes: list[Any] | None = None) -> list[T]:
    """`check(i, item)` of each item of a body's list that `check_shape` deferred, after
    holding the item to the same limits; `nodes`: the values `check_shape` counted. With a
    `memo`, an item `scope` sent before (same JSON bytes) is not checked again (an agent
    resends its whole conversation each turn: splitter/memo.py); `head`: the items' JSON
    bytes less the closing bracket, where the caller made them; `read`: the body they came
    from, through the memo (`items` are then those after its `start`). `shapes`, if given,
    gets what the memo holds per item (from the first item of the list)."""
    def shaped(i: int, item: Any) -> tuple[int, T]:
        return check_shape(item, limits, depth=ITEM_DEPTH) - 1, check(i, item)

    got = memo.map(scope, items, shaped, head=head, read=read) if memo is not None else [
        shaped(i, item) for i, item in enumerate(items)]
    if nodes + sum(map(_first, got)) > limits.max_nodes:  # in C: a pass per request
        raise bad(f"the request body has more than {limits.max_nodes} JSON values")
    if shapes is not None:
        shapes.extend(got)
    return list(map(_second, got))


def model_body(body: Any, limits: BodyLimits = DEFAULT_LIMITS) -> tuple[dict[str, Any], str]:
    """The start every API's body shares: a JSON object within `limits` (`check_shape`)
    that names a `model`. The body and its model."""
    body, model, _ = items_body(body, None, limits)
    return body, model


def items_body(body: Any, items: str | None, limits: BodyLimits = DEFAULT_LIMITS
               ) -> tuple[dict[str, Any], str, int]:
    """`model_body`, leaving the items of `body[items]` (when a list) to `checked_items`:
    also the values counted."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    deferred = body.get(items) if items is not None else None
    nodes = check_shape(body, limits, defer=deferred if isinstance(deferred, list) else None)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required", "model")
    return body, model, nodes


ARGUMENTS_DEPTH = 7  # body → messages → message → tool_calls → call → function → arguments


def check_arguments(arguments: str, param: str, limits: BodyLimits = DEFAULT_LIMITS) -> None:
    """Tool-call arguments sent as a JSON string are decoded and rendered as objects later:
    they must be JSON, or JSON cut short (a call max_tokens cut, sent back in the history:
    the object it describes is what renders), and are held to the same limits as if they
    had been sent inline."""
    if len(arguments) <= 2 * (limits.max_depth - ARGUMENTS_DEPTH) or not arguments.strip():
        return  # too short to nest too deep; invalid JSON is refused by the splitter
    try:
        decoded = orjson.loads(arguments)
    except orjson.JSONDecodeError as e:
        decoded = close_json(arguments)
        if decoded is None:
            raise bad(f"tool-call arguments are not valid JSON, nor JSON cut short: {e}",
                      param) from None
    check_shape(decoded, limits, depth=ARGUMENTS_DEPTH)


def number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be a number", name)
    if not lo <= value <= hi:  # also refuses NaN (orjson never decodes one; callers may)
        raise bad(f"'{name}' must be between {lo} and {hi}", name)
    return float(value)


def optional_int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer", name)
    if not lo <= value <= hi:
        raise bad(f"'{name}' must be between {lo} and {hi}", name)
    return value


def temperature(body: dict[str, Any], name: str = "temperature", *, default: float = 1.0,
                hi: float = 2.0) -> float:
    """A sampling temperature in [0, hi]; one below `GREEDY_TEMPERATURE` is greedy (0.0),
    as the worker would also treat it: dividing logits by it would overflow to NaN."""
    value = number(body, name, default, 0.0, hi)
    return 0.0 if value < GREEDY_TEMPERATURE else value


def string(value: Any, param: str, *, max_chars: int, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty_ok):
        raise bad(f"'{param}' must be a {'' if empty_ok else 'non-empty '}string", param)
    if len(value) > max_chars:
        raise bad(f"'{param}' is longer than {max_chars} characters", param)
    return value


def reasoning_effort(value: Any, param: str) -> str | None:
    """OpenAI's reasoning effort (`reasoning_effort`, the Responses API's `reasoning.effort`);
    what each template makes of it: splitter/reasoning.py `effort_template_kwargs`."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in REASONING_EFFORTS:
        raise bad(f"'{param}' must be one of {', '.join(REASONING_EFFORTS)}", param)
    return value


def rendered_chars(messages: tuple[dict[str, Any], ...],
                   tools: tuple[dict[str, Any], ...] = ()) -> int:
    """Characters every chat template renders for these messages and tools, at least: the
    content of system/developer/user/tool messages without surrounding whitespace (templates
    may trim; earlier assistant turns may be rewritten), and the tools' names and
    descriptions without any whitespace (every adapter renders them, the template's way or
    lowered to text, and may re-wrap them). A lower bound for the early token budget."""
    text = sum(len(m["content"].strip()) for m in messages
               if m["role"] in ALWAYS_RENDERED_ROLES and isinstance(m.get("content"), str))
    for tool in tools:
        fn = tool.get("function")
        if isinstance(fn, dict):
            for field in ("name", "description"):
                if isinstance(fn.get(field), str):
                    text += len("".join(fn[field].split()))
    return text


# ---- OpenAI chat completions ---------------------------------------------------------------

@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "auto" | "none" | "required" | "function"
    function: str | None = None

    def openai(self) -> str | dict[str, Any]:
        if self.mode == "function":
            return {"type": "function", "function": {"name": self.function}}
        return self.mode


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict[str, Any], ...]  # OpenAI message dicts, content normalized to str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    tools: tuple[dict[str, Any], ...]
    tool_choice: ToolChoice
    template_kwargs: dict[str, Any]
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: ResponseFormat | None = None
    grammar: Constraint | None = None  # SGLang's `regex` / `ebnf` extras
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None  # one of REASONING_EFFORTS

    @property
    def rendered_chars(self) -> int:
        return rendered_chars(self.messages)


def _content(value: Any, param: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad("only text content parts ({'type': 'text', 'text': ...}) are supported",
                          f"{param}[{i}]")
            texts.append(part["text"])
        return "".join(texts)
    raise bad("'content' must be a string, null or a list of text parts", param)


def _message(i: int, msg: Any, limits: BodyLimits) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad("each message must be an object", param)
    role = msg.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad(f"unknown role {role!r}; expected one of {sorted(ROLES)}", f"{param}.role")
    out = dict(msg)
    out["content"] = _content(msg.get("content"), f"{param}.content")
    if role == "tool" and "tool_call_id" in msg:
        string(msg["tool_call_id"], f"{param}.tool_call_id", max_chars=limits.max_name_chars,
               empty_ok=True)
    if "name" in msg and msg["name"] is not None:
        string(msg["name"], f"{param}.name", max_chars=limits.max_name_chars)
    if role in ("system", "developer", "user", "tool") and out["content"] is None:
        raise bad(f"a {role} message needs 'content'", f"{param}.content")
    calls = msg.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise bad("'tool_calls' must be a list on an assistant message", f"{param}.tool_calls")
        for j, call in enumerate(calls):
            cparam = f"{param}.tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise bad("each tool call needs function.name", cparam)
            string(fn.get("name"), f"{cparam}.function.name", max_chars=limits.max_name_chars)
            arguments = fn.get("arguments", "{}")
            if not isinstance(arguments, (str, dict)):
                raise bad("function.arguments must be a JSON string", f"{cparam}.function.arguments")
            if isinstance(arguments, str):
                check_arguments(arguments, f"{cparam}.function.arguments", limits)
            if call.get("id") is not None:
                string(call["id"], f"{cparam}.id", max_chars=limits.max_name_chars, empty_ok=True)
    return out


def _tools(body: dict[str, Any], limits: BodyLimits) -> tuple[dict[str, Any], ...]:
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    if len(tools) > limits.max_tools:
        raise bad(f"at most {limits.max_tools} tools are supported", "tools")
    check_function_tools(tools, max_name_chars=limits.max_name_chars, error=bad)
    return tuple(tools)


def _tool_choice(body: dict[str, Any], tools: tuple[dict[str, Any], ...]) -> ToolChoice:
    choice = body.get("tool_choice")
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise bad("tool_choice 'required' needs tools", "tool_choice")
        return ToolChoice(choice)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        return ToolChoice("function", check_choice_name(choice["function"].get("name"), tools,
                                                        error=bad))
    raise bad("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', ...}",
              "tool_choice")


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """OpenAI's `stream` and `stream_options.include_usage`."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return stream, bool(options.get("include_usage", False))


def stop_sequences(body: dict[str, Any], limits: BodyLimits) -> tuple[str, ...]:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or \
            not all(isinstance(s, str) and 0 < len(s) <= limits.max_stop_chars for s in stop):
        raise bad(f"'stop' must be a string or up to {MAX_STOP_STRINGS} non-empty strings of at "
                  f"most {limits.max_stop_chars} characters", "stop")
    return tuple(stop)


def parse_chat_request(body: Any, *, max_tokens_limit: int = MAX_TOKENS_LIMIT,
                       limits: BodyLimits = DEFAULT_LIMITS, memo: MessageMemo | None = None,
                       scope: bytes = b"") -> ChatRequest:
    """An OpenAI chat body (or a `Read` of one, through `memo.read`); with a `memo`,
    messages `scope` sent before are not checked again (`checked_items`)."""
    read = body if isinstance(body, Read) else None
    start = read.start if read is not None else 0  # messages decoded and checked before
    body, model, nodes = items_body(read.body if read is not None else body, "messages",
                                    limits)
    messages = body.get("messages")
    if not isinstance(messages, list) or not start + len(messages):
        raise bad("'messages' must be a non-empty list", "messages")
    if start + len(messages) > limits.max_messages:
        raise bad(f"at most {limits.max_messages} messages are supported", "messages")
    checked = checked_items(messages, nodes + start, limits,
                            lambda i, m: _message(i, m, limits), memo=memo, scope=scope,
                            read=read)
    n = optional_int(body, "n", 1, MAX_CHOICES) or 1
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise bad("'logprobs' must be a boolean", "logprobs")
    top_logprobs = optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top_logprobs and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    max_tokens = optional_int(body, "max_completion_tokens", 1, max_tokens_limit)
    if max_tokens is None:
        max_tokens = optional_int(body, "max_tokens", 1, max_tokens_limit)
    stream, include_usage = stream_flags(body)
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    for key in template_kwargs:
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise bad(f"chat_template_kwargs may not set {key!r}", f"chat_template_kwargs.{key}")
    tools = _tools(body, limits)
    top_k = optional_int(body, "top_k", -1, 1 << 20)
    return ChatRequest(
        model=model,
        messages=tuple(checked),
        max_tokens=max_tokens,
        temperature=temperature(body),
        top_p=number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=-1 if top_k in (None, 0) else top_k,
        seed=optional_int(body, "seed", -(1 << 63), (1 << 63) - 1),
        stop=stop_sequences(body, limits),
        stream=stream,
        include_usage=include_usage,
        tools=tools,
        tool_choice=_tool_choice(body, tools),
        template_kwargs=template_kwargs,
        n=n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        response_format=parse_response_format(body.get("response_format")),
        grammar=parse_grammar(body),
        parallel_tool_calls=parallel,
        reasoning_effort=reasoning_effort(body.get("reasoning_effort"), "reasoning_effort"),
    )
