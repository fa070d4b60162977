"""Rendering and tokenizing stay off the event loop: an early token budget that
refuses a 16 MiB message before it is rendered, and one split thread that lets `/health`
answer while a long split runs. In-process proxy (aiohttp test client), real worker."""

from __future__ import annotations

import asyncio
import threading

import pytest

from anchorcache.proxy.app import create_app
from anchorcache.proxy.config import ProxyConfig
from anchorcache.proxy.errors import ApiError
from anchorcache.proxy.running import STATE
from anchorcache.proxy.split_pool import TokenBudget
from anchorcache.proxy.splitter.tokenizers import load_tokenizer

MiB = 1 << 20
ODD_TEXTS = ["=" * 6000, " x" * 3000, "a" * 6000, "你好" * 3000, "🎉" * 2000,
             "e\u0301" * 3000, "\u1100\u1161\u11a8" * 2000, "0123456789" * 600,
             "<|im_start|>" * 500, "\n" * 3000 + "end"]


@pytest.mark.parametrize("name", [None, "qwen3", "llama3"])
def test_the_budget_never_exceeds_the_real_token_count(name):
    tok = load_tokenizer(name)
    budget = TokenBudget.for_tokenizer(tok, 1 << 20)
    assert budget.max_chars_per_token is not None
    for text in ODD_TEXTS:
        assert budget.min_tokens(len(text.strip())) <= len(tok.encode(text)), text[:20]


def test_the_budget_refuses_only_what_cannot_fit():
    budget = TokenBudget(context_tokens=100, max_chars_per_token=10)
    budget.check(990, None)  # at least 99 tokens + 1 new
    budget.check(900, 10)
    with pytest.raises(ApiError) as e:
        budget.check(991, None)
    assert e.value.kind == "context_length_exceeded"
    with pytest.raises(ApiError):
        budget.check(901, 10)
    TokenBudget(context_tokens=100, max_chars_per_token=None).check(10**9, None)  # no bound
    # `fits`: a bound under which `check` passes (the body's length, which is at least the
    # text's characters, spares the pass over the messages)
    assert budget.fits(990, None) and not budget.fits(991, None)
    assert budget.fits(900, 10) and not budget.fits(901, 10)


def chat(text: str, **extra) -> dict:
    return {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": text}],
            **extra}


@pytest.fixture()
async def client(aiohttp_client, worker, tmp_path):
    config = ProxyConfig(worker_urls=(worker.url,), max_body_bytes=32 * MiB, max_pending_splits=2,
                         state_dir=str(tmp_path))
    return await aiohttp_client(create_app(config))


@pytest.mark.slow
async def test_a_16_mib_message_is_refused_before_it_is_rendered(client):
    state = client.server.app[STATE]
    resp = await client.post("/v1/chat/completions", json=chat("word " * (16 * MiB // 5)))
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "context_length_exceeded"
    assert state.splits.runs == 0
    ok = await client.post("/v1/chat/completions", json=chat("hi"))
    assert ok.status == 200 and state.splits.runs == 1


@pytest.fixture()
def held_split(client, monkeypatch):
    """The adapter's split waits for `release` (set at the latest after 30 s, so that a
    split that runs on the event loop cannot deadlock the test): a slow split on demand."""
    state = client.server.app[STATE]
    entered, release = threading.Event(), threading.Event()
    split = state.adapter.split

    def held(*args, **kwargs):
        entered.set()
        release.wait(30)
        return split(*args, **kwargs)

    monkeypatch.setattr(state.adapter, "split", held)
    timer = threading.Timer(30, release.set)
    timer.start()
    yield entered, release
    release.set()
    timer.cancel()


@pytest.mark.slow
async def test_health_answers_while_a_split_runs(client, held_split):
    entered, release = held_split
    request = asyncio.create_task(client.post("/v1/chat/completions", json=chat("hi")))
    assert await asyncio.to_thread(entered.wait, 30)
    health = await client.get("/health")
    assert health.status == 200
    assert not release.is_set()  # answered while the split was still running
    models = await client.get("/v1/models")
    assert models.status == 200 and not release.is_set()
    release.set()
    assert (await request).status == 200


@pytest.mark.slow
async def test_splits_beyond_the_queue_bound_are_refused_503(client, held_split):
    entered, release = held_split
    first = [asyncio.create_task(client.post("/v1/chat/completions", json=chat(f"hi {i}")))
             for i in range(2)]
    assert await asyncio.to_thread(entered.wait, 30)
    for _ in range(3000):  # the second request reaches the queue
        if client.server.app[STATE].splits.pending == 2:
            break
        await asyncio.sleep(0.01)
    extra = await client.post("/v1/chat/completions", json=chat("one more"))
    assert extra.status == 503
    assert (await extra.json())["error"]["code"] == "overloaded"
    release.set()
    assert [(await t).status for t in first] == [200, 200]


async def test_a_free_thread_takes_the_next_tenants_split_in_turn(monkeypatch):
    """One split thread, tenant A's four requests queued before tenant B's one: B's split
    runs third (A's first two were on their way), not last; and A cannot queue past its own
    bound while B still can. A real adapter and tokenizer; the thread is held at first."""
    from anchorcache.proxy.split_pool import SplitPool
    from anchorcache.proxy.splitter import get_adapter

    adapter = get_adapter("auto", load_tokenizer("qwen3"))
    pool = SplitPool(adapter, max_pending=4, threads=1)  # 2 waiting per tenant at most
    order: list[bytes] = []
    gate = threading.Event()
    real = adapter.split

    def split(messages, tools, **kwargs):
        gate.wait(30)
        order.append(kwargs["scope"])
        return real(messages, tools, **kwargs)

    monkeypatch.setattr(adapter, "split", split)
    msgs = [{"role": "user", "content": "hi"}]

    def submit(tenant: str) -> asyncio.Task:
        return asyncio.create_task(pool.split(msgs, None, None, tenant=tenant,
                                              scope=tenant.encode()))

    a = [submit("a") for _ in range(3)]  # one running, two waiting: A's bound
    await asyncio.sleep(0.05)
    with pytest.raises(ApiError) as refused:
        await pool.split(msgs, None, None, tenant="a", scope=b"a")
    assert refused.value.kind == "overloaded"
    b = submit("b")  # another tenant still gets in
    await asyncio.sleep(0.05)
    gate.set()
    results = await asyncio.gather(*a, b)
    assert len({r.input_ids for r in results}) == 1
    assert order == [b"a", b"a", b"b", b"a"]  # first come, first served would be a, a, a, b
    pool.close()
