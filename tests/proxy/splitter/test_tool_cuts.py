"""Tool cuts (splitter/tool_cuts.py): where each tool's schema ends in the instruction prefix.

What they are for: a toolset that starts with another one's first `k` tools shares its
prompt up to the k-th tool cut, token for token, and finds that cut too. Checked on the BFCL
toolsets with each adapter that renders text, real tokenizers.
"""

from __future__ import annotations

import pytest

from anchorcache.proxy.splitter.tool_cuts import ToolCutLimits, ToolCutMemo, candidates, tool_cuts
from anchorcache.testing.data import conversations, turn_requests

TEXT_ADAPTERS = ("qwen3", "chatml", "llama3", "generic-qwen3")
EXTRA = {"type": "function", "function": {
    "name": "zz_extra", "description": "A tool no BFCL toolset has.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def convs():
    return conversations("base")[:12]


@pytest.mark.parametrize("name", TEXT_ADAPTERS)
def test_toolsets_sharing_their_first_tools_share_the_cut_and_its_tokens(adapters, convs, name):
    ad = adapters[name]
    for i, conv in enumerate(convs):
        msgs, tools = turn_requests(conv, 2)[1], conv["tools"]
        split = ad.split(msgs, tools)
        cuts, ks = split.tool_cuts, candidates(tools, ad.tool_cut_limits)
        assert len(cuts) == len(ks) >= 2, conv["id"]  # one cut per candidate, not per tool
        assert list(cuts) == sorted(set(cuts)) and cuts[-1] < split.instruction_cut
        other = convs[(i + 5) % len(convs)]["tools"]
        for k, pos in zip(ks, cuts, strict=True):
            names = {t["function"]["name"] for t in tools[:k]}
            rest = [t for t in other if t["function"]["name"] not in names] or [EXTRA]
            mixed = ad.split(msgs, tools[:k] + rest)
            assert mixed.input_ids[:pos] == split.input_ids[:pos], (conv["id"], k)
            assert pos in mixed.tool_cuts, (conv["id"], k)


def test_a_toolset_is_rendered_once(adapters, convs, monkeypatch):
    ad = adapters["qwen3"]
    ad.turns.clear()  # (no turn kept from another test: this one's first split is cold)
    conv = convs[0]
    first = ad.split(turn_requests(conv, 1)[0], conv["tools"])
    calls = []
    real = ad.render_pieces
    monkeypatch.setattr(ad, "render_pieces", lambda *a, **k: calls.append(1) or real(*a, **k))
    later = ad.split(turn_requests(conv, 3)[2], conv["tools"])
    assert later.tool_cuts == first.tool_cuts and len(calls) == 1  # the request's own render


@pytest.mark.parametrize("name", ("mistral", "harmony"))
def test_adapters_that_render_tokens_have_no_tool_cuts(adapters, name):
    tools = [EXTRA, {"type": "function", "function": dict(EXTRA["function"], name="zz_other")}]
    split = adapters[name].split([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "hi"}], tools)
    assert split.tool_cuts == ()


def test_one_tool_or_a_template_that_fails_gives_none():
    def encode(texts):
        return [[ord(c) for c in t] for t in texts]

    text = "<tools>\nA\nB\nC\n</tools>"
    ids = [ord(c) for c in text]
    renders = {1: "<tools>\nA\n</tools>", 2: "<tools>\nA\nB\n</tools>"}
    assert tool_cuts(text, ids, [1, 2], renders.__getitem__, encode) == (10, 12)
    assert tool_cuts(text, ids, [2], renders.__getitem__, encode) == (12,)
    assert tool_cuts(text, ids, [], renders.__getitem__, encode) == ()
    assert tool_cuts(text, ids, [1, 2], lambda k: 1 / 0, encode) == ()  # type: ignore[arg-type,return-value]


def test_a_boundary_inside_a_token_fails_closed():
    """A tokenizer that merges across a boundary: the pieces' ids differ from the prompt's,
    so there is no tool cut at all."""
    text = "<tools>\nA\nB\nC\n</tools>"

    def merging(texts):
        return [[ord(c) for c in t] for t in texts]

    ids = [ord(c) for c in text]
    ids[11] = 999  # the prompt's own encoding merged "\n" + "B" differently
    renders = {1: "<tools>\nA\n</tools>", 2: "<tools>\nA\nB\n</tools>"}
    assert tool_cuts(text, ids, [1, 2], renders.__getitem__, merging) == ()


def test_the_memo_is_bounded_and_keyed_by_the_text_and_scope():
    memo = ToolCutMemo(max_entries=2)
    assert memo.get_or_compute("a", lambda: (1,)) == (1,)
    assert memo.get_or_compute("a", lambda: (2,)) == (1,)
    assert memo.get_or_compute("a", lambda: (6,), b"tenant-b") == (6,)  # never another's
    memo = ToolCutMemo(max_entries=2)
    assert memo.get_or_compute("a", lambda: (1,)) == (1,)
    memo.get_or_compute("b", lambda: (3,))
    memo.get_or_compute("c", lambda: (4,))
    assert len(memo) == 2 and memo.get_or_compute("a", lambda: (5,)) == (5,)


def tool(i: int, chars: int = 400) -> dict:
    return {"type": "function", "function": {
        "name": f"tool_{i}", "description": ("d" * chars),
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


def test_candidates_depend_on_the_tools_before_them_only():
    limits = ToolCutLimits(spacing_tokens=512, max_renders=16)
    tools = [tool(i, 300 + 37 * (i % 7)) for i in range(80)]
    ks = candidates(tools, limits)
    assert 0 < len(ks) <= 16 and ks == sorted(set(ks)) and ks[-1] < len(tools)
    for k in ks:  # a toolset sharing the first k tools, then others, picks the same up to k
        other = candidates(tools[:k] + [tool(1000 + i, 50) for i in range(40)], limits)
        assert [c for c in other if c <= k] == [c for c in ks if c <= k]
    assert candidates(tools, ToolCutLimits(spacing_tokens=0)) == []


def test_a_thousand_large_tools_cost_a_bounded_number_of_renders(adapters, monkeypatch):
    """1,024 tools of 400-character descriptions: at most `max_renders` renders of the
    leading messages for the tool cuts, not one per tool, and none when the prompt is
    longer than the context (it cannot be served)."""
    ad = adapters["qwen3"]
    tools = [tool(i) for i in range(1024)]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    calls: list[int] = []
    real = ad.render_pieces
    monkeypatch.setattr(ad, "render_pieces",
                        lambda m, t, kw: calls.append(len(t or [])) or real(m, t, kw))
    split = ad.split(msgs, tools, scope=b"bounded-1")
    assert 1 + ad.tool_cut_limits.max_renders >= len(calls) > 1  # the request's own render first
    assert len(split.tool_cuts) == len(calls) - 1
    calls.clear()
    monkeypatch.setattr(ad, "tool_cut_limits", ToolCutLimits(max_prompt_tokens=32_768))
    assert len(split.input_ids) > 32_768
    assert ad.split(msgs, tools, scope=b"bounded-2").tool_cuts == () and len(calls) == 1


def test_the_split_memo_of_one_scope_is_not_anothers(adapters, monkeypatch):
    """A prefix another tenant (scope) sent is no faster to split: its cached ids and tool
    cuts are not looked up across scopes (checked by counting the encoder's calls)."""
    ad = adapters["qwen3"]
    tools = [tool(i) for i in range(40)]
    msgs = [{"role": "system", "content": "Scoped."}, {"role": "user", "content": "hi"}]
    first = ad.split(msgs, tools, scope=b"tenant-a")
    encoded: list[int] = []
    real = ad.guard.encode_batch
    monkeypatch.setattr(ad.guard, "encode_batch", lambda texts: encoded.append(len(texts))
                        or real(texts))
    assert ad.split(msgs, tools, scope=b"tenant-a") == first
    same_scope = sum(encoded)
    encoded.clear()
    assert ad.split(msgs, tools, scope=b"tenant-b") == first
    assert sum(encoded) > same_scope  # re-encoded and tool cuts found again, for B
