"""Parse and validate OpenAI request bodies once, at the HTTP edge, into typed records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ApiError
from .structured import Constraint, ResponseFormat, parse_grammar, parse_response_format

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 4
MAX_CHOICES = 16  # n (the worker contract's limit)
MAX_TOP_LOGPROBS = 20


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


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError("invalid_request", message, param=param)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"'{name}' must be a number", name)
    if not lo <= value <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}", name)
    return float(value)


def _optional_int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", name)
    if not lo <= value <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}", name)
    return value


def _content(value: Any, param: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad("only text content parts ({'type': 'text', 'text': ...}) are supported",
                           f"{param}[{i}]")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad("'content' must be a string, null or a list of text parts", param)


def _message(i: int, msg: Any) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise _bad("each message must be an object", param)
    role = msg.get("role")
    if role not in ROLES:
        raise _bad(f"unknown role {role!r}; expected one of {sorted(ROLES)}", f"{param}.role")
    out = dict(msg)
    out["content"] = _content(msg.get("content"), f"{param}.content")
    if role == "tool" and not isinstance(msg.get("tool_call_id", ""), str):
        raise _bad("'tool_call_id' must be a string", f"{param}.tool_call_id")
    if role in ("system", "developer", "user", "tool") and out["content"] is None:
        raise _bad(f"a {role} message needs 'content'", f"{param}.content")
    calls = msg.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise _bad("'tool_calls' must be a list on an assistant message", f"{param}.tool_calls")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _bad("each tool call needs function.name", f"{param}.tool_calls[{j}]")
            if not isinstance(fn.get("arguments", "{}"), (str, dict)):
                raise _bad("function.arguments must be a JSON string", f"{param}.tool_calls[{j}]")
    return out


def _tools(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad("each tool must be {'type': 'function', 'function': {'name': ...}}", f"tools[{i}]")
        if not isinstance(fn.get("parameters", {}), dict):
            raise _bad("function.parameters must be an object", f"tools[{i}].function.parameters")
    return tuple(tools)


def _tool_choice(body: dict[str, Any], tools: tuple[dict[str, Any], ...]) -> ToolChoice:
    choice = body.get("tool_choice")
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise _bad("tool_choice 'required' needs tools", "tool_choice")
        return ToolChoice(choice)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise _bad(f"tool_choice names an unknown function {name!r}", "tool_choice")
        return ToolChoice("function", name)
    raise _bad("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', ...}",
               "tool_choice")


def parse_chat_request(body: Any, *, max_tokens_limit: int) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required", "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    n = _optional_int(body, "n", 1, MAX_CHOICES) or 1
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise _bad("'logprobs' must be a boolean", "logprobs")
    top_logprobs = _optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top_logprobs and not logprobs:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    max_tokens = _optional_int(body, "max_completion_tokens", 1, max_tokens_limit)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1, max_tokens_limit)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or \
            not all(isinstance(s, str) and s for s in stop):
        raise _bad(f"'stop' must be a string or up to {MAX_STOP_STRINGS} non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    tools = _tools(body)
    top_k = _optional_int(body, "top_k", -1, 1 << 20)
    return ChatRequest(
        model=model,
        messages=tuple(_message(i, m) for i, m in enumerate(messages)),
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=-1 if top_k in (None, 0) else top_k,
        seed=_optional_int(body, "seed", -(1 << 63), (1 << 63) - 1),
        stop=tuple(stop),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        tools=tools,
        tool_choice=_tool_choice(body, tools),
        template_kwargs=template_kwargs,
        n=n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        response_format=parse_response_format(body.get("response_format")),
        grammar=parse_grammar(body),
        parallel_tool_calls=parallel,
    )
