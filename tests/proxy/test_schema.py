"""The request schema's limits and normalisation, in milliseconds (no server)."""

from __future__ import annotations

import json

import pytest

from anchorcache.proxy.errors import ApiError
from anchorcache.proxy.schema import (
    BodyLimits,
    check_arguments,
    check_shape,
    parse_chat_request,
    rendered_chars,
)

LIMITS = BodyLimits(max_depth=8, max_nodes=100)


def nested(levels: int):
    """`levels` containers around a scalar."""
    value: object = 1
    for i in range(levels):
        value = {"a": value} if i % 2 else [value]
    return value


def test_depth_is_counted_from_the_body():
    check_shape(nested(8), LIMITS)
    with pytest.raises(ApiError, match="deeper than 8"):
        check_shape(nested(9), LIMITS)
    check_shape(nested(7), LIMITS, depth=2)
    with pytest.raises(ApiError):
        check_shape(nested(8), LIMITS, depth=2)


def test_a_flat_array_past_the_node_limit_is_refused_before_it_is_walked():
    check_shape(list(range(99)), LIMITS)
    with pytest.raises(ApiError, match="more than 100"):
        check_shape(list(range(10**6)), LIMITS)
    with pytest.raises(ApiError):
        check_shape([{"a": list(range(40))} for _ in range(3)], LIMITS)


def test_a_body_nested_past_pythons_recursion_limit_is_refused_without_recursion():
    deep: object = 1
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ApiError):
        check_shape(deep)


def test_argument_strings_are_held_to_the_same_limits():
    limits = BodyLimits(max_depth=20)
    check_arguments(json.dumps(nested(14)), "p", limits)  # levels 7..20
    with pytest.raises(ApiError, match="deeper"):
        check_arguments(json.dumps(nested(15)), "p", limits)
    # JSON cut short (a call max_tokens cut, sent back) is held to the limits of what it says
    check_arguments(json.dumps(nested(14))[:-4], "p", limits)
    with pytest.raises(ApiError, match="deeper"):
        check_arguments(json.dumps(nested(15))[:-4], "p", limits)
    with pytest.raises(ApiError, match="deeper"):
        check_arguments("[" * 100, "p", limits)
    with pytest.raises(ApiError, match="not valid JSON, nor JSON cut short"):
        check_arguments('{"a": 1} ' + "x" * 200, "p", limits)
    with pytest.raises(ApiError, match="not valid JSON"):
        check_arguments("[" * 100_000, "p")  # past the json module's recursion: refused
    check_arguments("{oops", "p", limits)  # short: left to the splitter's message
    check_arguments("   ", "p", limits)


def body(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize("t,expected", [(0, 0.0), (1e-38, 0.0), (5e-324, 0.0), (9.9e-6, 0.0),
                                        (1e-5, 1e-5), (0.7, 0.7), (2, 2.0)])
def test_temperature_below_the_greedy_threshold_is_greedy(t, expected):
    assert parse_chat_request(body(temperature=t), max_tokens_limit=10).temperature == expected


@pytest.mark.parametrize("fields", [{"temperature": -0.1}, {"temperature": 2.5},
                                    {"temperature": True}, {"top_p": 0}, {"top_p": 1.5},
                                    {"top_k": -2}, {"seed": 1 << 64}, {"n": True},
                                    {"max_tokens": 11}, {"stop": [""]},
                                    {"chat_template_kwargs": {"tools": []}},
                                    {"chat_template_kwargs": {"not an identifier": 1}}])
def test_bad_fields_are_400(fields):
    with pytest.raises(ApiError) as e:
        parse_chat_request(body(**fields), max_tokens_limit=10)
    assert e.value.status == 400


def test_rendered_chars_counts_only_text_every_template_keeps():
    msgs = ({"role": "system", "content": "  abc  "}, {"role": "user", "content": "de"},
            {"role": "assistant", "content": "xxxxxxxx"}, {"role": "tool", "content": "f"})
    assert rendered_chars(msgs) == 6


def test_the_schema_check_memo_holds_no_schema():
    """The metaschema check is memoized by a digest: distinct large schemas (1 MiB each)
    leave a few hundred bytes each behind, not themselves."""
    import gc
    import tracemalloc

    from anchorcache.proxy.structured import check_schema

    def big(i: int) -> dict:
        return {"type": "object", "description": f"schema {i} " + "x" * (1 << 20)}

    check_schema(big(-1), "p")  # (the memo's own first allocations)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(8):
        check_schema(big(i), "p")
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert kept < 64 << 10, kept  # 8 schemas of 1 MiB: 8 MiB if they were kept


@pytest.mark.parametrize("kind", ["regex", "ebnf"])
def test_a_raw_grammar_is_bounded_in_size(kind):
    from anchorcache.proxy.structured import MAX_GRAMMAR_CHARS, parse_grammar

    limit = MAX_GRAMMAR_CHARS[kind]
    body = {kind: "a" * limit}
    assert parse_grammar(body).text == body[kind]
    with pytest.raises(ApiError) as e:
        parse_grammar({kind: "a" * (limit + 1)})
    assert e.value.kind == "invalid_request" and e.value.param == kind
