"""cache_control anchor hints (`proxy/cut_hints.py`) on real adapters and tokenizers: a hint
becomes a HINT cut exactly at the end of the marked message, only where that boundary is
verified, and the planner snapshots it."""

from __future__ import annotations

import asyncio

import pytest

from anchorcache.proxy.anthropic_schema import parse_messages_request
from anchorcache.proxy.cut_hints import hint_positions, with_hint_cuts
from anchorcache.proxy.planner import Planner
from anchorcache.proxy.splitter import get_adapter
from anchorcache.proxy.splitter.tokenizers import load_tokenizer
from anchorcache.proxy.splitter.types import CutKind
from anchorcache.testing.adapters import split_fn

CC = {"type": "ephemeral"}
TOOL = {"name": "lookup", "input_schema": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module", params=["smollm2", "qwen3"])
def adapter(request):
    return get_adapter("auto", load_tokenizer(request.param))


def _hinted(adapter, body):
    req = parse_messages_request({"model": "m", "max_tokens": 4, **body}, max_tokens_limit=10**6)
    gen = req.generation
    msgs, tools = [dict(m) for m in gen.messages], [dict(t) for t in gen.tools] or None
    plain = adapter.split(msgs, tools)
    hinted = asyncio.run(with_hint_cuts(split_fn(adapter), plain, msgs, tools, None,
                                        req.generation.cut_after))
    return msgs, tools, plain, hinted


def _hint_positions(split):
    return [c.position for c in split.cuts if c.kind is CutKind.HINT]


def test_a_marked_turn_becomes_a_hint_cut_at_the_end_of_its_message(adapter):
    msgs, tools, plain, hinted = _hinted(adapter, {"system": "Be brief.", "messages": [
        {"role": "user", "content": "Tell me about Rome."},
        {"role": "assistant", "content": "Rome is the capital of Italy."},
        {"role": "user", "content": [{"type": "text", "text": "And Berlin?", "cache_control": CC}]},
        {"role": "assistant", "content": "Berlin is the capital of Germany."},
        {"role": "user", "content": "And Paris?"}]})
    [pos] = _hint_positions(hinted)
    prefix = adapter.split(msgs[:4], tools)  # system + the first three messages
    assert prefix.cuts[-1].position == pos  # the end of the marked message in its own render
    assert hinted.input_ids == plain.input_ids
    assert hinted.input_ids[:pos] == prefix.input_ids[:pos]
    # the other cuts are unchanged (a TURN cut the planner skipped may have become the hint)
    assert [c for c in hinted.cuts if c.position != pos] == \
        [c for c in plain.cuts if c.position != pos]
    positions = [c.position for c in hinted.cuts]
    assert positions == sorted(set(positions))
    snapshots = [s.depth for s in Planner("m", "e").plan(hinted, b"namespace").request.snapshot]
    assert pos in snapshots
    assert pos not in [s.depth for s in Planner("m", "e").plan(plain, b"namespace").request.snapshot]


def test_a_hint_inside_the_newest_messages_adds_a_cut_the_splitter_does_not_report(adapter):
    msgs, _, plain, hinted = _hinted(adapter, {"system": "Be brief.", "tools": [TOOL],
                                               "messages": [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup",
                                           "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "42", "cache_control": CC},
            {"type": "text", "text": "Now explain it."}]}]})
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    [pos] = _hint_positions(hinted)
    assert pos not in [c.position for c in plain.cuts]
    end = next(c.position for c in plain.cuts if c.kind is CutKind.MESSAGES)
    assert plain.cuts[0].position < pos < end


def test_no_cut_where_the_template_merges_the_marked_block_with_the_next(adapter):
    # consecutive tool results render as one turn: there is no boundary between them
    _, _, plain, hinted = _hinted(adapter, {"tools": [TOOL], "messages": [
        {"role": "user", "content": "Look both up."},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "lookup", "input": {}},
            {"type": "tool_use", "id": "t2", "name": "lookup", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "1", "cache_control": CC},
            {"type": "tool_result", "tool_use_id": "t2", "content": "2"}]}]})
    assert hinted == plain


def test_marks_on_system_tools_and_the_last_message_need_no_extra_cut(adapter):
    _, _, plain, hinted = _hinted(adapter, {
        "system": [{"type": "text", "text": "Be brief.", "cache_control": CC}],
        "tools": [{**TOOL, "cache_control": CC}], "cache_control": CC,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hi", "cache_control": CC}]}]})
    assert hinted == plain
    assert {CutKind.INSTRUCTION, CutKind.MESSAGES} <= {c.kind for c in plain.cuts}


def test_every_verified_hint_has_a_position_for_its_lease(adapter):
    """`hint_positions` places each mark's lease: a system or tool mark at the instruction
    cut, a mark on the last message (or a top-level one) at the end of the messages, one in
    between at its HINT cut; the marks' TTLs travel with them (5 minutes without one)."""
    hour = {"type": "ephemeral", "ttl": "1h"}
    body = {"system": [{"type": "text", "text": "Be brief.", "cache_control": hour}],
            "cache_control": CC, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": CC}]},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye."}]}
    req = parse_messages_request({"model": "m", "max_tokens": 4, **body}, max_tokens_limit=10**6)
    gen = req.generation
    assert gen.cut_ttl_s == {1: 3600.0, 2: 300.0, 4: 300.0}
    msgs, _, plain, hinted = _hinted(adapter, body)
    found = asyncio.run(hint_positions(split_fn(adapter), plain, msgs, None, None, gen.cut_after))
    end = next(c.position for c in plain.cuts if c.kind is CutKind.MESSAGES)
    assert found == {1: plain.instruction_cut, 2: _hint_positions(hinted)[0], 4: end}
    tools_only = {"tools": [{**TOOL, "cache_control": CC}],
                  "messages": [{"role": "user", "content": "Hi"}]}
    msgs, tools, plain, _ = _hinted(adapter, tools_only)
    assert asyncio.run(hint_positions(split_fn(adapter), plain, msgs, tools, None, (0,))) == {
        0: plain.instruction_cut}
