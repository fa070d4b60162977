"""Structured output: the grammar a chat request puts on the worker's sampler.

The proxy turns `tool_choice`, `response_format` and SGLang's `regex` / `ebnf` extras into
one constraint in SGLang's own terms (`SamplingParams.json_schema` / `regex` / `ebnf` /
`structural_tag`); the SGLang worker hands it to SGLang, the embedded worker compiles it
with xgrammar (the same library) and masks its sampler. Nothing here imports xgrammar (the
proxy imports no torch): a structural tag is plain JSON, `{"type": "structural_tag",
"format": ...}` (xgrammar's format objects).

Tool calls follow the adapter's own markup, so the output parser reads what the grammar
allows and the next turn renders it back the same way:
- hermes (qwen3, chatml, generic): `<tool_call>\\n{"name": N, "arguments": ARGS}\\n</tool_call>`,
  calls separated by a newline (qwen3 with thinking: an optional `<think>` block first);
- llama3: `{"name": N, "parameters": ARGS}`, calls separated by "; ";
- mistral: `[TOOL_CALLS][{"name": N, "arguments": ARGS}, ...]`;
- harmony: `<|channel|>commentary to=functions.N <|constrain|>json<|message|>ARGS`, ended by
  the `<|call|>` stop token (an optional analysis message first).
`required` / a named function: the output is calls only (at least one; one when named or
`parallel_tool_calls` is false). `auto`: free text, but once the model writes a call's
opening it must finish a valid call (xgrammar's triggered tags). `ARGS` validate against the
tool's `parameters` schema. A grammar replaces the adapter's forced prefix.

Schemas are checked with `jsonschema` before anything is sent (a 400 names the field);
Python type names that agent datasets use in schemas (`float`, `dict`, `int`, ...) are
first rewritten to JSON Schema types.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any

import cachetools
import jsonschema
import orjson

from .errors import ApiError
from .splitter.memo import MessageMemo

# Python type names some tool sets (BFCL's among them) use in place of JSON Schema's
PY_TYPES = {"float": "number", "int": "integer", "dict": "object", "list": "array",
            "tuple": "array", "bool": "boolean", "str": "string"}
# Which call markup each adapter writes (by adapter name)
FAMILY = {"qwen3": "hermes", "chatml": "hermes", "generic": "hermes", "llama3": "llama3",
          "mistral": "mistral", "harmony": "harmony"}
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object (as SGLang sends it)


@dataclass(frozen=True)
class ResponseFormat:
    """`response_format`: `json_object` (any object) or `json_schema` (its schema)."""

    type: str  # "json_object" | "json_schema"
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool = False


@dataclass(frozen=True)
class Constraint:
    """One SGLang sampling-parameter constraint: `kind` is its field name."""

    kind: str  # "json_schema" | "regex" | "ebnf" | "structural_tag"
    text: str

    def sampling_fields(self) -> dict[str, Any]:
        return {self.kind: self.text}


def _bad(message: str, param: str) -> ApiError:
    return ApiError("invalid_request", message, param=param)


# ---- parsing request fields (at the HTTP edge) -------------------------------------------

def parse_response_format(value: Any) -> ResponseFormat | None:
    if value is None:
        return None
    param = "response_format"
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("response_format must be {'type': 'text' | 'json_object' | 'json_schema'}", param)
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return ResponseFormat("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format json_schema needs a 'json_schema' object", f"{param}.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("response_format.json_schema needs a 'name'", f"{param}.json_schema.name")
    schema = spec.get("schema", {})
    strict = spec.get("strict") or False
    if not isinstance(strict, bool):
        raise _bad("'strict' must be a boolean", f"{param}.json_schema.strict")
    return ResponseFormat("json_schema", check_schema(schema, f"{param}.json_schema.schema"),
                          name, strict)


# The longest raw grammar accepted: the worker compiles it before sampling (xgrammar, in
# time and memory that grow with it), so it is bounded here, as every other body part is
MAX_GRAMMAR_CHARS = {"regex": 4096, "ebnf": 32768}


def parse_grammar(body: dict[str, Any]) -> Constraint | None:
    """SGLang's OpenAI-API extras: a `regex` or an `ebnf` grammar for the content."""
    given = [k for k in ("regex", "ebnf") if body.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise _bad("give at most one of 'regex' and 'ebnf'", given[1])
    kind = given[0]
    text = body[kind]
    if not isinstance(text, str) or not text.strip():
        raise _bad(f"'{kind}' must be a non-empty string", kind)
    if len(text) > MAX_GRAMMAR_CHARS[kind]:
        raise _bad(f"'{kind}' is longer than {MAX_GRAMMAR_CHARS[kind]} characters", kind)
    return Constraint(kind, text)


def normalize_schema(schema: Any) -> Any:
    """`schema` with Python type names (`float`, `dict`, ...) rewritten to JSON Schema's."""
    if isinstance(schema, list):
        return [normalize_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            if value == "any":
                continue
            value = PY_TYPES.get(value, value)
        elif key == "type" and isinstance(value, list):
            value = [PY_TYPES.get(v, v) if isinstance(v, str) else v for v in value]
        elif key in ("properties", "$defs", "definitions", "patternProperties"):
            value = {k: normalize_schema(v) for k, v in value.items()} \
                if isinstance(value, dict) else value
        else:
            value = normalize_schema(value)
        out[key] = value
    return out


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    """The normalized schema; a 400 naming `param` if it is not a valid JSON Schema."""
    if not isinstance(schema, dict):
        raise _bad("a JSON schema must be an object", param)
    schema = normalize_schema(schema)
    try:
        canonical = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, TypeError):
        error = _schema_error_of(schema)
    else:
        error = _cached_schema_error(hashlib.blake2b(canonical, digest_size=16).digest(), schema)
    if error is not None:
        raise _bad(error, param)
    return schema


MAX_SCHEMA_ERROR_CHARS = 512


@cachetools.cached(cachetools.LRUCache(maxsize=4096), key=lambda digest, _schema: digest,
                   lock=threading.Lock())
def _cached_schema_error(digest: bytes, schema: dict[str, Any]) -> str | None:
    """Checking against the metaschema is most of the proxy's time per request, and agents
    send the same tools every turn: cached by a digest of the schema's canonical JSON (the
    key; `schema` is only read on a miss), so the cache holds digests and short errors,
    under 700 bytes an entry, never the schemas themselves."""
    return _schema_error_of(schema)


def _schema_error_of(schema: dict[str, Any]) -> str | None:
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)[:128]
        message = e.message[:MAX_SCHEMA_ERROR_CHARS]
        return f"invalid JSON schema{f' at {where}' if where else ''}: {message}"
    return None


# ---- building the constraint -------------------------------------------------------------

def _tag(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema}


def _seq(*elements: dict[str, Any] | None) -> dict[str, Any]:
    """A sequence of the given formats (None: left out)."""
    parts = [e for e in elements if e is not None]
    return parts[0] if len(parts) == 1 else {"type": "sequence", "elements": parts}


def _const(text: str) -> dict[str, Any] | None:
    return {"type": "const_string", "value": text} if text else None


@dataclass(frozen=True)
class CallMarkup:
    """How one adapter family writes tool calls (see the module docstring)."""

    begin: str  # a call's opening; "{name}" is replaced by the JSON-quoted function name
    end: str
    separator: str  # between calls
    trigger: str  # the text that starts a call in free text (`auto`)
    open: str = ""  # before the first call
    close: str = ""  # after the last call
    parallel: bool = True  # several calls per response

    def call(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return _tag(self.begin.replace("{name}", json.dumps(name, ensure_ascii=False)),
                    _schema(schema), self.end)


MARKUP = {
    "hermes": CallMarkup(begin='<tool_call>\n{"name": {name}, "arguments": ',
                         end="}\n</tool_call>", separator="\n", trigger="<tool_call>"),
    "llama3": CallMarkup(begin='{"name": {name}, "parameters": ', end="}", separator="; ",
                         trigger='{"name": '),
    "mistral": CallMarkup(begin='{"name": {name}, "arguments": ', end="}", separator=", ",
                          trigger="[TOOL_CALLS]", open="[TOOL_CALLS][", close="]"),
}
_HARMONY_CALL = "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
_HARMONY_ANALYSIS = _tag("<|channel|>analysis<|message|>", {"type": "any_text"},
                         "<|end|><|start|>assistant")


@dataclass(frozen=True)
class ToolSpec:
    name: str
    schema: dict[str, Any]


def tool_specs(tools: tuple[dict[str, Any], ...], *, lenient: bool,
               only: str | None = None) -> list[ToolSpec]:
    """Each tool's name and checked schema (just the tool named `only`, if given).
    `lenient`: a tool whose schema is invalid gets any JSON object as arguments instead of
    a 400 (`auto`, where the grammar only helps)."""
    specs = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if only is not None and fn["name"] != only:
            continue
        schema = fn.get("parameters")
        if schema is None:
            schema = {"type": "object"}
        try:
            schema = check_schema(schema, f"tools[{i}].function.parameters")
        except ApiError:
            if not lenient:
                raise
            schema = {"type": "object"}
        specs.append(ToolSpec(fn["name"], schema))
    return specs


def _call_list(markup: CallMarkup, specs: list[ToolSpec], one: bool) -> dict[str, Any]:
    """At least one call (exactly one if `one`), separated the family's way."""
    return {"type": "tags_with_separator",
            "tags": [markup.call(s.name, s.schema) for s in specs],
            "separator": markup.separator, "at_least_one": True, "stop_after_first": one}


def tool_call_format(family: str, specs: list[ToolSpec], mode: str, *, parallel: bool,
                     thinking: bool = False) -> dict[str, Any]:
    """The structural-tag format for `mode` ("auto" | "required" | "function", the latter
    with `specs` holding just the named tool)."""
    one = mode == "function" or not parallel
    if family == "harmony":
        calls = [_tag(_HARMONY_CALL.replace("{name}", s.name), _schema(s.schema), "")
                 for s in specs]
        if mode == "auto":
            # a call's header may come in either order; the recipient starts it
            return {"type": "triggered_tags", "triggers": ["to=functions."],
                    "tags": [_tag(f"to=functions.{s.name}",
                                  _seq({"type": "regex", "pattern":
                                        r"(<\|channel\|>commentary)? ?(<\|constrain\|>)?json"
                                        r"<\|message\|>"}, _schema(s.schema)), "")
                             for s in specs]}
        # one call per harmony message; `<|call|>` (a stop token) ends the turn after it
        call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        return _seq({"type": "optional", "content": _HARMONY_ANALYSIS}, call)
    markup = MARKUP[family]
    think = {"type": "optional", "content": _tag("<think>", {"type": "any_text"},
                                                 "</think>\n\n")} if thinking else None
    if mode == "auto":
        if markup.open:  # mistral: one list of calls that runs to the end of the output
            return {"type": "triggered_tags", "triggers": [markup.trigger],
                    "tags": [_tag(markup.open, _call_list(markup, specs, one), markup.close)],
                    "stop_after_first": True}
        return {"type": "triggered_tags", "triggers": [markup.trigger],
                "tags": [markup.call(s.name, s.schema) for s in specs],
                "stop_after_first": one}
    return _seq(think, _const(markup.open), _call_list(markup, specs, one),
                _const(markup.close))


def structural_tag(fmt: dict[str, Any]) -> Constraint:
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": fmt},
                                                   ensure_ascii=False))


def build_constraint(*, adapter: str, tools: tuple[dict[str, Any], ...], mode: str,
                     function: str | None, response_format: ResponseFormat | None,
                     grammar: Constraint | None, parallel_tool_calls: bool = True,
                     thinking: bool = False, memo: MessageMemo | None = None,
                     scope: bytes = b"") -> Constraint | None:
    """The request's constraint, or None (free text). `mode` is the tool choice
    ("auto" | "none" | "required" | "function" with `function` named). With a `memo`, a
    toolset's constraint is kept there by the JSON bytes of the tools and the other
    arguments, per `scope` (the caller's namespace: splitter/memo.py), since an agent sends
    the same tools every turn; a toolset that fails is refused again each time."""
    if memo is not None and tools and response_format is None and grammar is None:
        toolset = (adapter, mode, function, parallel_tool_calls, thinking, tools)
        return memo.map(scope, [toolset], lambda _, __: build_constraint(
            adapter=adapter, tools=tools, mode=mode, function=function, response_format=None,
            grammar=None, parallel_tool_calls=parallel_tool_calls, thinking=thinking))[0]
    family = FAMILY.get(adapter)
    use_tools = bool(tools) and mode != "none" and family is not None
    if grammar is not None:
        if use_tools:
            raise _bad("a regex or ebnf grammar cannot be combined with tools; set "
                       "tool_choice to 'none'", grammar.kind)
        return grammar
    content = None
    if response_format is not None:
        content = json.dumps(response_format.schema, ensure_ascii=False) \
            if response_format.schema is not None else JSON_OBJECT_SCHEMA
    if not use_tools:
        if content is None:
            return None
        if thinking and family == "hermes":
            return structural_tag(_seq(
                {"type": "optional", "content": _tag("<think>", {"type": "any_text"},
                                                     "</think>\n\n")},
                _schema(json.loads(content))))
        return Constraint("json_schema", content)
    assert family is not None
    specs = tool_specs(tools, lenient=mode == "auto",
                       only=function if mode == "function" else None)
    fmt = tool_call_format(family, specs, mode, parallel=parallel_tool_calls,
                           thinking=thinking)
    if mode == "auto" and content is not None:
        # structured content or calls: the content's schema, else calls only
        fmt = {"type": "or", "elements": [
            _schema(json.loads(content)),
            tool_call_format(family, specs, "required", parallel=parallel_tool_calls,
                             thinking=thinking)]}
    return structural_tag(fmt)
