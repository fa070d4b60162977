"""Hypothesis strategies of random agent conversations in OpenAI format (the splitter's
property tests), and the prefix relation of a JSON value cut short (the partial JSON
parsers' tests)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=24)
nonempty = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc", "Z")),
                   min_size=1, max_size=16)
names = st.sampled_from(["get_weather", "ls", "cd", "send_message", "book_flight", "mv"])
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), text)
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(nonempty, inner, max_size=3)), max_leaves=6)
arguments = st.dictionaries(nonempty, json_value, max_size=3)


@st.composite
def tool(draw):
    props = draw(st.dictionaries(nonempty, st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "object"]), "description": text}),
        max_size=3))
    return {"type": "function", "function": {
        "name": draw(names), "description": draw(text),
        "parameters": {"type": "object", "properties": props,
                       "required": sorted(props)[:1]}}}


@st.composite
def tool_round(draw, counter):
    """An assistant message with tool calls and the tool results."""
    calls = []
    for _ in range(draw(st.integers(1, 3))):
        counter[0] += 1
        args = draw(arguments)
        calls.append({"id": f"call_{counter[0]}", "type": "function",
                      "function": {"name": draw(names),
                                   "arguments": json.dumps(args, ensure_ascii=False)
                                   if draw(st.booleans()) else args}})
    content = draw(st.one_of(st.none(), st.just(""), text))
    msgs = [{"role": "assistant", "content": content, "tool_calls": calls}]
    for c in calls:
        msgs.append({"role": "tool", "tool_call_id": c["id"], "content": draw(text)})
    return msgs


@st.composite
def conversation(draw, min_rounds: int = 1):
    """(messages, tools): ends with user or tool messages, as a request does."""
    counter = [0]
    msgs = []
    system = draw(st.one_of(st.none(), text))
    if system is not None:
        msgs.append({"role": "system", "content": system})
    tools = draw(st.lists(tool(), max_size=3, unique_by=lambda t: t["function"]["name"]))
    for r in range(draw(st.integers(min_rounds, 3))):
        if r:
            msgs.append({"role": "assistant", "content": draw(text)})
        user = draw(text)
        msgs.append({"role": "user", "content": draw(st.sampled_from(
            [user, [{"type": "text", "text": user}]]))})
        if tools and draw(st.booleans()):
            msgs += draw(tool_round(counter))
    return msgs, (tools or None)


def next_turn(draw_text: str = "more, please") -> list[dict]:
    return [{"role": "assistant", "content": "Done."},
            {"role": "user", "content": draw_text}]


def is_prefix(part: Any, whole: Any) -> bool:
    """Whether `part`, the value a JSON text cut short describes, is where `whole` starts."""
    if isinstance(part, dict) and isinstance(whole, dict):
        keys = list(part)
        return keys == list(whole)[:len(keys)] and all(
            is_prefix(part[k], whole[k]) if k == keys[-1] else part[k] == whole[k] for k in keys)
    if isinstance(part, list) and isinstance(whole, list):
        return not part or (len(part) <= len(whole) and part[:-1] == whole[:len(part) - 1]
                            and is_prefix(part[-1], whole[len(part) - 1]))
    if isinstance(part, str) and isinstance(whole, str):  # a cut may split a surrogate pair
        return whole.encode("utf-16-le", "surrogatepass").startswith(
            part.encode("utf-16-le", "surrogatepass"))
    if isinstance(part, bool) or isinstance(whole, bool):
        return part == whole
    return part == whole or (isinstance(part, int | float) and isinstance(whole, int | float)
                             and json.dumps(whole).startswith(json.dumps(part)))
