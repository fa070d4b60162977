"""The BFCL agent conversations: every request splits with an instruction cut and, from the
second request on, a conversation cut; incremental splitting equals whole splitting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
FILES = ["bfcl_multi_turn_base.conversations.json",
         "bfcl_multi_turn_long_context.conversations.json"]


def requests_of(messages: list[dict]) -> list[list[dict]]:
    """The prompts an agent sends: every prefix that ends where the model answers."""
    return [messages[:end] for end in range(1, len(messages))
            if messages[end]["role"] == "assistant" and messages[end - 1]["role"] != "assistant"]


@pytest.fixture(scope="module", params=FILES)
def conversations(request):
    return json.loads((DATA / request.param).read_text())


@pytest.mark.parametrize("name", ["qwen3", "chatml"])
def test_every_request_splits(adapters, conversations, name):
    adapter = adapters[name]
    adapter.cache.clear()
    num_requests = 0
    for conv in conversations:
        for n, msgs in enumerate(requests_of(conv["messages"])):
            result = adapter.split(msgs, conv["tools"])
            assert result.instruction_cut is not None, conv["id"]
            if n:
                assert result.conversation_cut is not None, (conv["id"], n)
                assert result.conversation_cut > result.instruction_cut
            num_requests += 1
    assert num_requests >= len(conversations) * 2
    assert adapter.cache.hits > 0


def test_incremental_equals_whole_on_data(adapters, conversations):
    adapter = adapters["qwen3"]
    for conv in conversations[:: max(1, len(conversations) // 6)]:
        adapter.cache.clear()
        for msgs in requests_of(conv["messages"]):
            before = adapter.cache.hits
            incremental = adapter.split(msgs, conv["tools"])
            assert incremental == adapter.split(msgs, conv["tools"], use_cache=False)
        assert adapter.cache.hits > before or len(requests_of(conv["messages"])) == 1


@pytest.mark.parametrize("name", ["qwen3", "generic-qwen3"])
def test_concurrent_splits_equal_sequential(adapters, conversations, name):
    """Splits from several threads at once (as in an executor) share the adapter's caches
    and give exactly the sequential results."""
    from concurrent.futures import ThreadPoolExecutor

    adapter = adapters[name]
    jobs = [(msgs, conv["tools"]) for conv in conversations[:12]
            for msgs in requests_of(conv["messages"])]
    expected = [adapter.split(m, t) for m, t in jobs]
    if hasattr(adapter, "cache"):
        adapter.cache.clear()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda job: adapter.split(*job), jobs * 2))
    assert results == expected * 2
