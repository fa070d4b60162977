"""One toolset sent in two orders through real proxies and the real default worker: by
default the two orders are two prompts (two instruction anchors, no hit between them); with
`--canonical-tools` they are one (the second request restores the first's anchors). Anchors
on and off give token-identical outputs in both modes."""

from __future__ import annotations

import uuid

import httpx
import pytest

from anchorcache.proxy.splitter import get_adapter
from anchorcache.proxy.splitter.tokenizers import load_tokenizer
from anchorcache.testing.inprocess import proxy_in_process

pytestmark = pytest.mark.slow


def _tool(name: str, reverse: bool) -> dict:
    props = {"path": {"type": "string"}, "count": {"type": "integer"}}
    if reverse:
        props = dict(reversed(list(props.items())))
    fn = {"name": name, "description": f"{name} files",
          "parameters": {"type": "object", "properties": props}}
    if reverse:
        fn = dict(reversed(list(fn.items())))
    return {"type": "function", "function": fn}


ORDER_A = [_tool(n, False) for n in ("zip_files", "list_files", "move_files")]
ORDER_B = [_tool(n, True) for n in ("move_files", "zip_files", "list_files")]


@pytest.fixture(scope="module")
def proxies(worker):
    with proxy_in_process(worker.url) as client_on, \
            proxy_in_process(worker.url, anchors=False) as client_off, \
            proxy_in_process(worker.url, canonical_tools=True) as canon_on, \
            proxy_in_process(worker.url, anchors=False, canonical_tools=True) as canon_off:
        yield {"client": (client_on, client_off), "canonical": (canon_on, canon_off)}


def _chat(server, messages, tools) -> dict:
    body = {"model": "default", "messages": messages, "tools": tools, "temperature": 0,
            "max_tokens": 8}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _same(pair, messages, tools) -> dict:
    on, off = (_chat(s, messages, tools) for s in pair)
    assert on["choices"][0]["message"] == off["choices"][0]["message"]
    assert on["usage"]["completion_tokens"] == off["usage"]["completion_tokens"]
    return on


def _cached(reply) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("mode", ["client", "canonical"])
def test_one_toolset_in_two_orders(proxies, mode):
    # a fresh system prompt: no anchor of another test can match
    messages = [{"role": "system", "content": f"Session {uuid.uuid4().hex}. Be brief."},
                {"role": "user", "content": "Which tools do you have?"}]
    first = _same(proxies[mode], messages, ORDER_A)
    assert _cached(first) == 0
    second = _same(proxies[mode], messages, ORDER_B)
    adapter = get_adapter("auto", load_tokenizer(None), canonical_tools=mode == "canonical")
    a, b = adapter.split(messages, ORDER_A), adapter.split(messages, ORDER_B)
    if mode == "client":  # two prompts, two instruction anchors: nothing to restore
        assert a.input_ids[: a.instruction_cut] != b.input_ids[: b.instruction_cut]
        assert _cached(second) == 0
    else:  # one prompt: the second request restores the first one's anchors
        assert a.input_ids == b.input_ids
        assert _cached(second) >= b.instruction_cut
