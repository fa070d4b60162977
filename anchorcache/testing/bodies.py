"""Hypothesis strategies of request bodies, for the parser tests (no server) and the fuzz
tests (an in-process proxy) of each API: mostly well formed, sometimes anything, so that
many bodies get deep into parsing and the rest are refused early."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from anchorcache.proxy.responses_items import encrypt_reasoning

# ---- chat completions (and legacy completions) ---------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
any_json = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


def maybe(good: st.SearchStrategy[Any], weight_bad: bool = False) -> st.SearchStrategy[Any]:
    """Mostly `good`, sometimes anything."""
    return st.one_of(good, good, good, any_json) if not weight_bad else st.one_of(good, any_json)


text = st.text(max_size=30)
temperature = st.one_of(st.floats(0, 2), st.floats(0, 1e-30), st.just(5e-324),
                        st.floats(allow_nan=False, allow_infinity=False), any_json)


# ---- Anthropic messages ---------------------------------------------------------------------

CACHE_CONTROL = {"type": "ephemeral"}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Current weather for a city.",
                     "input_schema": {"type": "object",
                                      "properties": {"city": {"type": "string"}}}}

_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=4),
                  st.floats(allow_nan=False, allow_infinity=False))
small_json = st.recursive(_leaf, lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=6)


def mostly(valid: Any, bad: Any = small_json, one_in: int = 8) -> Any:
    """Mostly well-formed, sometimes anything: so that many bodies get deep into parsing."""
    return st.sampled_from(range(one_in)).flatmap(lambda i: bad if i == one_in - 1 else valid)


_cc = mostly(st.sampled_from([CACHE_CONTROL, {"type": "ephemeral", "ttl": "1h"}]), one_in=20)
_text = st.fixed_dictionaries({"type": st.just("text"),
                               "text": mostly(st.text(min_size=1, max_size=6))},
                              optional={"cache_control": _cc})
_use = st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.sampled_from(["t1", "t2"]),
                              "name": mostly(st.just("get_weather")),
                              "input": mostly(st.just({"city": "Oslo"}))},
                             optional={"cache_control": _cc})
_result = st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": mostly(st.sampled_from(["t1", "t2"]))},
    optional={"content": mostly(st.one_of(st.text(max_size=6), st.lists(_text, max_size=2))),
              "is_error": mostly(st.booleans()), "cache_control": _cc})
_other = st.one_of(small_json, st.fixed_dictionaries(
    {"type": st.sampled_from(["image", "thinking", "document"])}))


def _turn(role: str, blocks: Any) -> Any:
    content = st.one_of(st.text(min_size=1, max_size=6), st.lists(blocks, min_size=1, max_size=3))
    return st.fixed_dictionaries({"role": mostly(st.just(role), st.just("system"), 40),
                                  "content": mostly(content, one_in=30)})


_user = _turn("user", mostly(st.one_of(_text, _result), _other, 30))
_assistant = _turn("assistant", mostly(st.one_of(_text, _use), _other, 30))
_messages = st.tuples(st.lists(st.tuples(_user, _assistant), max_size=3), _user).map(
    lambda t: [m for pair in t[0] for m in pair] + [t[1]])
anthropic_bodies = st.fixed_dictionaries(
    {"model": st.just("default"), "max_tokens": mostly(st.just(16), one_in=30),
     "messages": mostly(_messages, one_in=30)},
    optional={"system": mostly(st.one_of(st.text(max_size=6), st.lists(_text, max_size=2))),
              "tools": mostly(st.sampled_from([[ANTHROPIC_WEATHER], [{**ANTHROPIC_WEATHER, "cache_control": CACHE_CONTROL}]])),
              "tool_choice": mostly(st.sampled_from([
                  {"type": "any"}, {"type": "auto"}, {"type": "none"},
                  {"type": "tool", "name": "get_weather"}])),
              "stop_sequences": mostly(st.lists(st.text(min_size=1, max_size=3), max_size=2)),
              "temperature": mostly(st.floats(0, 1)), "top_k": mostly(st.integers(0, 50)),
              "stream": mostly(st.booleans()), "metadata": mostly(st.just({"user_id": "u"})),
              "cache_control": _cc, "thinking": mostly(st.sampled_from([
                  {"type": "disabled"}, {"type": "adaptive"},
                  {"type": "enabled", "budget_tokens": 1024}])),
              "output_config": mostly(st.just({"effort": "high"}))})


# ---- OpenAI Responses -----------------------------------------------------------------------

RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather.",
                     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                     "strict": True}

_words_r = st.text(min_size=1, max_size=6)
_part_r = st.fixed_dictionaries({"type": mostly(st.sampled_from(["input_text", "output_text"]),
                                               st.sampled_from(["input_image", "refusal"]), 20),
                               "text": mostly(_words_r)})
_content_r = mostly(st.one_of(_words_r, st.lists(_part_r, max_size=2)))
_call_id_r = st.sampled_from(["call_1", "call_2"])
_item_r = st.one_of(
    st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "assistant", "developer"]),
                                           st.just("tool"), 30), "content": _content_r},
                          optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": mostly(_call_id_r),
                           "name": mostly(st.just("get_weather")),
                           "arguments": mostly(st.sampled_from(['{"city": "Oslo"}', "{}",
                                                                 '{"city": "Os', "nope"]))}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": mostly(_call_id_r),
                           "output": _content_r}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.just([])},
                          optional={"content": mostly(st.lists(st.fixed_dictionaries(
                              {"type": st.just("reasoning_text"), "text": _words_r}), max_size=1)),
                              "encrypted_content": mostly(st.sampled_from(
                                  ["opaque", encrypt_reasoning("r")]))}),
    st.fixed_dictionaries({"type": st.sampled_from(["web_search_call", "custom_tool_call",
                                                    "custom_tool_call_output", "item_reference"])},
                          optional={"call_id": _call_id_r, "input": _words_r, "output": _words_r,
                                    "name": st.just("apply_patch")}),
    small_json)
_tools_r = st.lists(st.one_of(st.just(RESPONSES_WEATHER), st.just({"type": "web_search"}),
                            st.just({"type": "namespace", "name": "ns", "tools": [
                                {"type": "function", "name": "lookup"}]}), small_json), max_size=3)
responses_bodies = st.fixed_dictionaries(
    {"model": st.just("default"),
     "input": mostly(st.one_of(_words_r, st.lists(_item_r, min_size=1, max_size=5)), one_in=30)},
    optional={"instructions": mostly(_words_r), "tools": mostly(_tools_r),
              "tool_choice": mostly(st.sampled_from(
                  ["auto", "none", "required", {"type": "function", "name": "get_weather"}])),
              "text": mostly(st.sampled_from([{"format": {"type": "json_object"}},
                                               {"format": {"type": "text"}}])),
              "max_output_tokens": mostly(st.integers(1, 64)),
              "temperature": mostly(st.floats(0, 2)), "store": mostly(st.booleans()),
              "stream": mostly(st.booleans()), "include": mostly(st.just(
                  ["reasoning.encrypted_content"])),
              "reasoning": mostly(st.just({"effort": "low"}))})
