"""The BFCL agent conversations: every request splits with an instruction cut and, from the
second request on, a conversation cut; incremental splitting equals whole splitting."""

from __future__ import annotations

import itertools

import pytest

from anchorcache.testing.data import DATASETS
from anchorcache.testing.data import conversations as load


def requests_of(messages: list[dict]) -> list[list[dict]]:
    """The prompts an agent sends: every prefix that ends where the model answers."""
    return [messages[:end] for end in range(1, len(messages))
            if messages[end]["role"] == "assistant" and messages[end - 1]["role"] != "assistant"]


@pytest.fixture(scope="module", params=DATASETS)
def conversations(request):
    return load(request.param)


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
    """Each turn of a conversation, split from the last turn's split (turns.py) or from the
    prefix cache, equals its split from nothing, ids, cuts and key bytes."""
    adapter = adapters["qwen3"]
    for conv in conversations[:: max(1, len(conversations) // 6)]:
        adapter.cache.clear()
        adapter.turns.clear()
        turns = adapter.turns.hits
        requests = requests_of(conv["messages"])
        for msgs in requests:
            incremental = adapter.split(msgs, conv["tools"])
            whole = adapter.split(msgs, conv["tools"], use_cache=False)
            assert incremental == whole
            assert incremental.token_bytes == whole.token_bytes
        assert adapter.turns.hits == turns + len(requests) - 1


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


@pytest.mark.parametrize("name", ["qwen3", "chatml"])
def test_a_stable_tail_is_a_prefix_of_the_next_turn(adapters, conversations, name):
    """`stable_tail` (the planner leaves a hybrid model's conversation cut out on it): each
    request's messages cut is a prefix of the agent's next request."""
    adapter = adapters[name]
    checked = 0
    for conv in conversations:
        requests = requests_of(conv["messages"])
        for now, later in itertools.pairwise(requests):
            a, b = adapter.split(now, conv["tools"]), adapter.split(later, conv["tools"])
            assert a.stable_tail
            (m,) = [c.position for c in a.cuts if c.kind.value == "messages"]
            assert b.input_ids[:m] == a.input_ids[:m], (conv["id"], len(now))
            checked += 1
    assert checked >= len(conversations)
