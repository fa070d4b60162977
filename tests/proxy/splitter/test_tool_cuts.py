"""Tool cuts (splitter/tool_cuts.py): where each tool's schema ends in the instruction prefix.

What they are for: a toolset that starts with another one's first `k` tools shares its
prompt up to the k-th tool cut, token for token, and finds that cut too. Checked on the BFCL
toolsets with each adapter that renders text, real tokenizers.
"""

from __future__ import annotations

import pytest

from anchorcache.proxy.splitter.tool_cuts import ToolCutMemo, tool_cuts
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
        cuts = split.tool_cuts
        assert len(cuts) == len(tools) - 1, conv["id"]
        assert list(cuts) == sorted(set(cuts)) and cuts[-1] < split.instruction_cut
        other = convs[(i + 5) % len(convs)]["tools"]
        for k in (1, len(tools) // 2, len(tools) - 1):
            names = {t["function"]["name"] for t in tools[:k]}
            rest = [t for t in other if t["function"]["name"] not in names] or [EXTRA]
            mixed = ad.split(msgs, tools[:k] + rest)
            pos = cuts[k - 1]
            assert mixed.input_ids[:pos] == split.input_ids[:pos], (conv["id"], k)
            assert pos in mixed.tool_cuts, (conv["id"], k)


def test_a_toolset_is_rendered_once(adapters, convs, monkeypatch):
    ad = adapters["qwen3"]
    conv = convs[0]
    first = ad.split(turn_requests(conv, 1)[0], conv["tools"])
    calls = []
    real = ad.render_pieces
    monkeypatch.setattr(ad, "render_pieces", lambda *a: calls.append(1) or real(*a))
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
    assert tool_cuts(text, ids, 3, renders.__getitem__, encode) == (10, 12)
    assert tool_cuts(text, ids, 1, renders.__getitem__, encode) == ()
    assert tool_cuts(text, ids, 3, lambda k: 1 / 0, encode) == ()  # type: ignore[arg-type,return-value]


def test_a_boundary_inside_a_token_fails_closed():
    """A tokenizer that merges across a boundary: the pieces' ids differ from the prompt's,
    so there is no tool cut at all."""
    text = "<tools>\nA\nB\nC\n</tools>"

    def merging(texts):
        return [[ord(c) for c in t] for t in texts]

    ids = [ord(c) for c in text]
    ids[11] = 999  # the prompt's own encoding merged "\n" + "B" differently
    renders = {1: "<tools>\nA\n</tools>", 2: "<tools>\nA\nB\n</tools>"}
    assert tool_cuts(text, ids, 3, renders.__getitem__, merging) == ()


def test_the_memo_is_bounded_and_keyed_by_the_text():
    memo = ToolCutMemo(max_entries=2)
    assert memo.get_or_compute("a", lambda: (1,)) == (1,)
    assert memo.get_or_compute("a", lambda: (2,)) == (1,)
    memo.get_or_compute("b", lambda: (3,))
    memo.get_or_compute("c", lambda: (4,))
    assert len(memo) == 2 and memo.get_or_compute("a", lambda: (5,)) == (5,)
