"""A split made from the last turn's (splitter/turns.py) equals the split made from nothing:
ids, cuts, tool cuts and key bytes, over random conversations that grow, branch, repeat a
turn and change a turn the kept split rendered (hypothesis), for every adapter that reuses
turns; and a turn is reused only within its scope, tools and template arguments."""

from __future__ import annotations

import copy

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anchorcache import wire
from anchorcache.defaults import CONVERSATIONS_PER_SCOPE
from anchorcache.proxy.splitter.types import SplitError
from anchorcache.testing.strategies import text, tool, tool_round

ADAPTERS = ["qwen3", "chatml", "llama3"]
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@st.composite
def assistant(draw):
    """A plain answer, one with its reasoning (field or think block), or tool calls."""
    kind = draw(st.sampled_from(["plain", "reasoning", "think", "calls"]))
    content = draw(text)
    if kind == "reasoning":
        return [{"role": "assistant", "content": content, "reasoning_content": draw(text)}]
    if kind == "think":
        return [{"role": "assistant", "content": f"<think>\n{draw(text)}\n</think>\n\n{content}"}]
    if kind == "calls":  # with its reasoning, sometimes (Qwen3 keeps it after the last query)
        msgs = draw(tool_round([0]))
        if draw(st.booleans()):
            msgs[0]["reasoning_content"] = draw(text)
        return msgs
    return [{"role": "assistant", "content": content}]


@st.composite
def user(draw):
    """A user query; sometimes one that looks like a tool response (Qwen3's template tells
    them apart by that), sometimes a developer or system message before it."""
    out = []
    if draw(st.integers(0, 5)) == 0:
        out.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(text)})
    body = draw(text)
    if draw(st.integers(0, 4)) == 0:
        body = f"<tool_response>\n{body}\n</tool_response>"
    out.append({"role": "user", "content": body})
    return out


@st.composite
def growing(draw):
    """(messages, tools, the request ends in order): a conversation whose requests end at
    user or tool messages (some inside a run of tool results), some repeated, some going
    back to an earlier one."""
    msgs: list[dict] = []
    if draw(st.booleans()):
        msgs.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(text)})
    tools = draw(st.lists(tool(), max_size=3, unique_by=lambda t: t["function"]["name"]))
    msgs += draw(user())
    for _ in range(draw(st.integers(1, 6))):
        msgs += draw(assistant()) if tools else [{"role": "assistant", "content": draw(text)}]
        if draw(st.booleans()):
            msgs += draw(user())
    if msgs[-1]["role"] == "assistant":
        msgs += draw(user())
    stops = [i + 1 for i, m in enumerate(msgs) if m["role"] in ("user", "tool") and (
        i + 1 == len(msgs) or msgs[i + 1]["role"] != "tool" or draw(st.integers(0, 3)) == 0)]
    order = []
    for stop in stops:
        order.append(stop)
        if draw(st.integers(0, 4)) == 0:
            order.append(stop)  # the same request again (a retry)
        if draw(st.integers(0, 4)) == 0:
            order.append(draw(st.sampled_from(stops)))  # back to an earlier turn (a branch)
    return msgs, tools or None, order


@pytest.mark.parametrize("name", ADAPTERS)
@SETTINGS
@given(case=growing(), thinking=st.sampled_from([None, {"enable_thinking": False}]))
def test_a_split_from_the_last_turn_equals_one_from_nothing(adapters, name, case, thinking):
    adapter = adapters[name]
    msgs, tools, order = case
    scope = b"turns-%d" % id(case)
    hits = adapter.turns.hits
    for stop in order:
        request = copy.deepcopy(msgs[:stop])
        got = adapter.split(request, tools, template_kwargs=thinking, scope=scope)
        want = adapter.split(copy.deepcopy(msgs[:stop]), tools, template_kwargs=thinking,
                             scope=b"cold", use_cache=False)
        assert got == want
        assert got.token_bytes == want.token_bytes
        assert got.anchor_cuts == want.anchor_cuts  # (got's kept with its turn)
        assert _body(got) == _body(want)
    assert adapter.turns.hits > hits or len(order) == 1


@pytest.mark.parametrize("name", ADAPTERS)
@SETTINGS
@given(case=growing(), at=st.integers(0, 1000), edit=text)
def test_a_changed_earlier_message_is_rendered_anew(adapters, name, case, at, edit):
    """The next request changes a message the kept split rendered (an agent that compacts
    or edits its history): nothing of the kept split past the change is reused."""
    adapter = adapters[name]
    msgs, tools, _ = case
    scope = b"edit-%d" % id(case)
    adapter.split(copy.deepcopy(msgs), tools, scope=scope)
    changed = copy.deepcopy(msgs) + [{"role": "assistant", "content": "ok"},
                                     {"role": "user", "content": "next"}]
    i = at % len(msgs)
    changed[i]["content"] = (changed[i]["content"] if isinstance(changed[i]["content"], str)
                             else "") + edit + "!"
    got = adapter.split(copy.deepcopy(changed), tools, scope=scope)
    want = adapter.split(changed, tools, scope=b"cold", use_cache=False)
    assert got == want and got.token_bytes == want.token_bytes
    assert got.anchor_cuts == want.anchor_cuts
    assert _body(got) == _body(want)


def _body(split) -> bytes:
    """The `/generate` body's ids as the proxy writes them (a kept turn's JSON, extended),
    checked against the ids themselves."""
    body = wire.encode(split.input_ids)
    assert orjson.loads(body) == list(split.input_ids)
    return body


@pytest.mark.parametrize("name", ADAPTERS)
def test_a_turn_is_reused_only_with_its_scope_tools_and_arguments(adapters, name):
    adapter = adapters[name]
    tools = [{"type": "function", "function": {"name": n, "description": n, "parameters": {
        "type": "object", "properties": {}}}} for n in ("ls", "cd")]
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    longer = first + [{"role": "assistant", "content": "hello"},
                      {"role": "user", "content": "list files"}]
    adapter.split(copy.deepcopy(first), tools, scope=b"owner")
    for kw in ({"scope": b"other"}, {"scope": b"owner", "tools": tools[:1]},
               {"scope": b"owner", "template_kwargs": {"enable_thinking": False}}):
        hits = adapter.turns.hits
        kw = {"tools": tools} | kw
        got = adapter.split(copy.deepcopy(longer), **kw)
        assert adapter.turns.hits == hits, kw  # not from the owner's turn
        assert got == adapter.split(copy.deepcopy(longer), use_cache=False,
                                    **{k: v for k, v in kw.items() if k != "scope"})
    hits = adapter.turns.hits
    adapter.split(copy.deepcopy(longer), tools, scope=b"owner")
    assert adapter.turns.hits == hits + 1


def test_a_split_names_the_prompt_it_extends_among_many_in_flight(adapters):
    """The planner follows a conversation from the prompt its split extends: that prompt's
    own bytes, kept while a tenant has up to CONVERSATIONS_PER_SCOPE conversations in flight,
    never another scope's."""
    adapter = adapters["qwen3"]
    adapter.turns.clear()

    def chat(i, turns):
        msgs = [{"role": "system", "content": "be brief"}]
        for t in range(turns):
            msgs += [{"role": "user", "content": f"conversation {i} asks {t}"},
                     {"role": "assistant", "content": f"answer {t}"}]
        return msgs + [{"role": "user", "content": f"conversation {i} asks {turns}"}]

    firsts = [adapter.split(chat(i, 0), None, scope=b"tenant")
              for i in range(CONVERSATIONS_PER_SCOPE)]
    assert all(s.prior_token_bytes is None for s in firsts)
    for i in reversed(range(CONVERSATIONS_PER_SCOPE)):  # the oldest last: all still kept
        later = adapter.split(chat(i, 1), None, scope=b"tenant")
        assert later.prior_token_bytes is firsts[i].token_bytes, i
        assert later.token_bytes.startswith(firsts[i].token_bytes)
    assert adapter.split(chat(0, 1), None, scope=b"other").prior_token_bytes is None
    adapter.turns.clear()


def test_kept_turns_stay_within_their_bytes(adapters):
    adapter = adapters["qwen3"]
    adapter.turns.clear()
    limit, adapter.turns.max_bytes = adapter.turns.max_bytes, 256 << 10
    try:
        for i in range(40):
            msgs = [{"role": "user", "content": f"conversation {i} " + "word " * 300}]
            adapter.split(msgs, None, scope=b"bytes-%d" % (i % 7))
            assert adapter.turns.size_bytes <= 256 << 10
    finally:
        adapter.turns.max_bytes = limit
        adapter.turns.clear()



def test_tools_are_memoized_per_scope_and_a_bad_list_every_time(adapters):
    """The tools normalized and defused once per caller and tools JSON (`_safe_tools`): the
    same list in another scope is its own entry, a changed tool is another, and a bad list
    is refused on every request (never kept)."""
    adapter = adapters["qwen3"]
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "list <|im_end|> files"}]
    context = orjson.dumps([tools, None, None])
    first = adapter._safe_tools(copy.deepcopy(tools), None, b"a", context)
    assert adapter._safe_tools(copy.deepcopy(tools), None, b"a", context) == first
    assert adapter._safe_tools(copy.deepcopy(tools), None, b"a", context) is first
    assert adapter._safe_tools(copy.deepcopy(tools), None, b"b", context) is not first
    changed = copy.deepcopy(tools)
    changed[0]["function"]["name"] = "dir"
    other = adapter._safe_tools(changed, None, b"a", orjson.dumps([changed, None, None]))
    assert other[0]["function"]["name"] == "dir"
    split = adapter.split(copy.deepcopy(msgs), changed, scope=b"a")
    assert split == adapter.split(copy.deepcopy(msgs), changed, use_cache=False)
    bad = [{"type": "function", "function": {"name": "ls", "parameters": "not a schema"}}]
    for _ in range(2):
        with pytest.raises(SplitError):
            adapter.split(copy.deepcopy(msgs), copy.deepcopy(bad), scope=b"a")


ID = st.integers(0, (1 << 31) - 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(ID, max_size=30), st.data())
def test_ids_json_is_extended_as_the_ids_are(ids, data):
    """A turn's ids' JSON is the kept turn's cut at a chunk's end and the new ids' (any cut,
    no new ids, none kept): it equals the JSON of the ids, and the ends it gives are where
    that JSON is after that many ids."""
    from anchorcache.proxy.splitter.turns import extend_json, json_ends

    base = data.draw(st.integers(0, len(ids)))
    new = data.draw(st.lists(ID, max_size=10))
    text = orjson.dumps(ids)
    at = json_ends(text, [base])[0]
    counts = sorted(data.draw(st.lists(st.integers(base, base + len(new)), max_size=5)))
    got, ends = extend_json(text, at, base, new, counts)
    whole = orjson.dumps(ids[:base] + new)
    assert got == whole
    assert ends == json_ends(whole, counts)
    for k, e in zip(counts, ends, strict=True):
        assert orjson.loads(whole[:e] + b"]") == (ids[:base] + new)[:k]
