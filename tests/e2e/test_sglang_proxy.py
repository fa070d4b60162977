"""The proxy in front of a real SGLang worker (tiny Qwen3 with the real tokenizer, CPU),
the openai SDK as the client: a short BFCL replay with anchors on equals anchors off token
for token and restores the history, a stream equals its non-stream twin, a prompt over
SGLang's pool is the proxy's own 400; and a worker reply that ends in an abort is an error
at the client, never a completion."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from anchorcache.cli import free_port
from anchorcache.testing.data import conversations, turn_requests
from anchorcache.testing.isolation import check_tenants_stay_apart
from anchorcache.testing.servers import SGLANG_TEST_ARGS, proxy_process

pytestmark = pytest.mark.slow

# the session's SGLang server (tests/conftest.py): its KV pool is ~2.3x the longest replay
# request, so a restored prefix (up to 4.3k tokens) passes the 0.5 lock budget
POOL = int(SGLANG_TEST_ARGS[SGLANG_TEST_ARGS.index("--max-total-tokens") + 1])
TURNS = 3


@pytest.fixture(scope="module")
def sglang_stack(sglang):
    """(worker, anchors-on proxy, anchors-off proxy) over the session's SGLang server."""
    w = sglang
    with proxy_process(w.url, "--anchors") as on, proxy_process(w.url, "--no-anchors") as off:
        yield w, on, off


def client(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="", max_retries=0, timeout=600)


def flush_device(worker) -> None:
    resp = httpx.post(worker.url + "/flush_cache", timeout=60)
    assert resp.status_code == 200, resp.text


def chat(proxy, messages, tools, max_tokens=8, **kw):
    return client(proxy).chat.completions.create(
        model="default", messages=messages, tools=tools or openai.NOT_GIVEN, temperature=0,
        max_tokens=max_tokens, **kw)


def test_replay_with_anchors_equals_without_and_restores_history(sglang_stack):
    """Every request starts from an empty SGLang tree (`/flush_cache`), so a hit with
    anchors on can only come from the host tier; without anchors nothing is cached."""
    worker, on, off = sglang_stack
    staged = httpx.get(worker.url + "/anchor/stats", timeout=30).json()["staged"]
    convs = conversations("base")[:2]
    for conv in convs:
        for turn, messages in enumerate(turn_requests(conv, TURNS), 1):
            flush_device(worker)
            cold = chat(off, messages, conv["tools"])
            flush_device(worker)
            warm = chat(on, messages, conv["tools"])
            assert warm.choices[0].message == cold.choices[0].message
            assert warm.choices[0].finish_reason == cold.choices[0].finish_reason
            assert warm.usage.completion_tokens == cold.usage.completion_tokens
            assert warm.usage.prompt_tokens == cold.usage.prompt_tokens > 1000
            assert cold.usage.prompt_tokens_details.cached_tokens == 0
            cached = warm.usage.prompt_tokens_details.cached_tokens
            if turn >= 2:  # the instruction and the conversation so far come back
                assert 0 < cached < warm.usage.prompt_tokens, (conv["id"], turn)
    stats = httpx.get(worker.url + "/anchor/stats", timeout=30).json()
    assert stats["staged"] <= staged  # every anchor the replay wrote was confirmed


def test_stream_equals_non_stream(sglang_stack):
    _, on, _ = sglang_stack
    conv = conversations("base")[0]
    messages = turn_requests(conv, 2)[1]
    plain = chat(on, messages, conv["tools"], max_tokens=12)
    content, calls, finish, usage = [], {}, None, None
    for event in chat(on, messages, conv["tools"], max_tokens=12, stream=True,
                      stream_options={"include_usage": True}):
        usage = event.usage or usage
        for choice in event.choices:
            content.append(choice.delta.content or "")
            for tc in choice.delta.tool_calls or ():
                call = calls.setdefault(tc.index, ["", ""])
                call[0] += tc.function.name or ""
                call[1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    msg = plain.choices[0].message
    assert "".join(content) == (msg.content or "")
    assert [tuple(calls[i]) for i in sorted(calls)] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls or ()]
    assert finish == plain.choices[0].finish_reason
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_prompt_over_the_pool_is_the_proxys_400(sglang_stack):
    worker, on, off = sglang_stack
    limit = httpx.get(worker.url + "/model_info", timeout=30).json()["max_context_tokens"]
    assert limit < POOL  # not the model's 32k context: what the pool holds for one request
    long = " ".join(["word"] * (POOL + 500))
    for proxy in (on, off):
        with pytest.raises(openai.BadRequestError) as e:
            chat(proxy, [{"role": "user", "content": long}], None)
        assert e.value.code == "context_length_exceeded", e.value
    assert httpx.get(worker.url + "/health", timeout=30).json()["running_requests"] == []


class AbortingFront:
    """A fault injector in front of a real worker: passes every call through, but turns the
    last `/generate` event's `finish_reason` into `{"type": "abort"}` (a well-formed abort,
    which no real worker of ours sends any more: SGLang's is now an error event)."""

    def __init__(self, worker_url: str) -> None:
        from aiohttp import web

        self.worker_url = worker_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.forward)
        self.runner = web.AppRunner(app)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def forward(self, request):
        import aiohttp
        from aiohttp import web

        body = await request.read()
        async with aiohttp.ClientSession() as session, session.request(
                request.method, self.worker_url + request.path, data=body,
                headers={"Content-Type": "application/json"}) as up:
            if request.path != "/generate" or up.status != 200:
                return web.Response(body=await up.read(), status=up.status,
                                    content_type=up.content_type)
            out = web.StreamResponse(headers={"Content-Type": up.headers["Content-Type"]})
            await out.prepare(request)
            async for line in up.content:
                if line.startswith(b"data: {") and b"meta_info" in line:
                    event = json.loads(line[6:])
                    event["meta_info"]["finish_reason"] = {"type": "abort"}
                    line = b"data: " + json.dumps(event).encode() + b"\n"
                elif line.startswith(b"{") and b"meta_info" in line:
                    event = json.loads(line)
                    event["meta_info"]["finish_reason"] = {"type": "abort"}
                    line = json.dumps(event).encode()
                await out.write(line)
            await out.write_eof()
            return out

    def __enter__(self):
        from aiohttp import web

        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.runner.setup(), self.loop).result()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        asyncio.run_coroutine_threadsafe(site.start(), self.loop).result()
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def test_a_worker_abort_is_an_error_not_a_stop(sglang_stack):
    """A worker reply whose `finish_reason` is `abort` reaches the client as a 502
    `worker_error` (non-stream) or an error event (stream), never as a normal `stop`."""
    worker, _, _ = sglang_stack
    messages = [{"role": "user", "content": "Count from 1 to 5."}]
    with AbortingFront(worker.url) as front, proxy_process(front.url, "--no-anchors") as proxy:
        with pytest.raises(openai.APIStatusError) as e:
            chat(proxy, messages, None)
        assert e.value.status_code == 502 and "abort" in str(e.value), e.value
        with pytest.raises(openai.APIError) as e:
            for _ in chat(proxy, messages, None, stream=True):
                pass
        assert "abort" in str(e.value), e.value


def test_n_choices_with_logprobs_through_the_proxy(sglang_stack):
    """`n = 3` and `logprobs` reach SGLang: three choices from one prompt prefill, each
    with one logprob entry (and its two alternatives) per completion token."""
    _, on, _ = sglang_stack
    conv = conversations("base")[0]
    messages = turn_requests(conv, 1)[0]
    reply = client(on).chat.completions.create(
        model="default", messages=messages, temperature=1.0, seed=3, max_tokens=6, n=3,
        logprobs=True, top_logprobs=2)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    single = chat(on, messages, None, max_tokens=6)
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens
    for c in reply.choices:
        entries = c.logprobs.content
        assert entries and all(len(e.top_logprobs) == 2 for e in entries)
        assert all(e.logprob <= 0 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
                   for e in entries)
        assert "".join(e.token for e in entries) == (c.message.content or "")


def test_tenants_never_see_each_others_prompts_in_sglangs_cache(sglang):
    """SGLang's own radix tree is keyed by each request's namespace (its `extra_key`): the
    same long prompt from another tenant is a miss, through both APIs (dense, page size 1)."""
    with proxy_process(sglang.url) as proxy:
        check_tenants_stay_apart(proxy, sglang.url)
