"""Worker down, worker dying mid-stream, client gone mid-stream: errors, no hangs, no leftovers."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import httpx
import openai
import pytest

from anchorcache.testing.inprocess import proxy_in_process
from anchorcache.testing.servers import worker_process

pytestmark = pytest.mark.slow

LONG = [{"role": "user", "content": "Count from 1 to 500, one number per line."}]


def _running(worker_url: str) -> list[str]:
    return httpx.get(worker_url + "/health", timeout=10).json()["running_requests"]


def _wait_idle(worker_url: str, timeout_s: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (running := _running(worker_url)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running


@pytest.fixture()
def own_worker(default_model_dir):
    """A worker this test may kill (a process of its own; the proxy in front of it runs in
    this one)."""
    with worker_process(model=str(default_model_dir)) as server:
        yield server


def test_worker_down_is_503(own_worker):
    with proxy_in_process(own_worker.url) as proxy:
        own_worker.kill()
        resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=30,
                          json={"model": "default", "messages": LONG, "max_tokens": 5})
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "worker_unavailable"
        assert httpx.get(proxy.url + "/health", timeout=30).status_code == 503  # degraded, alive
        stream = httpx.post(proxy.url + "/v1/chat/completions", timeout=30,
                            json={"model": "default", "messages": LONG, "stream": True})
        assert stream.status_code == 503


def test_worker_dying_mid_stream_ends_with_error_event(own_worker):
    with proxy_in_process(own_worker.url) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model="default", messages=LONG, max_tokens=400,
                                                temperature=0, stream=True)
        seen = 0
        with pytest.raises(openai.APIError) as err:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    seen += 1
                    if seen == 3:
                        own_worker.kill()
        assert seen >= 3
        assert "worker" in str(err.value).lower()


def test_a_worker_dying_mid_stream_fails_the_response(own_worker):
    """The Responses API's stream ends with `response.failed` (what Codex waits for): the
    output so far, the error a `server_error`."""
    with proxy_in_process(own_worker.url) as proxy:
        events: list[dict] = []
        body = {"model": "default", "input": LONG[0]["content"], "max_output_tokens": 400,
                "temperature": 0, "stream": True, "store": False}
        with httpx.stream("POST", proxy.url + "/v1/responses", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
                    deltas = sum(e["type"] == "response.output_text.delta" for e in events)
                    if deltas == 3 and own_worker.proc.poll() is None:
                        own_worker.kill()
        last = events[-1]
        assert last["type"] == "response.failed", [e["type"] for e in events[-3:]]
        failed = last["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert "worker" in failed["error"]["message"].lower()
        text = failed["output"][0]["content"][0]["text"]
        assert text and text == "".join(e["delta"] for e in events
                                         if e["type"] == "response.output_text.delta")


def test_worker_error_mid_request_is_502(worker, proxy):
    """The session's worker runs with `--fault-injection`: the next decode step raises."""
    httpx.post(worker.url + "/debug/fault", json={"where": "decode"}).raise_for_status()
    resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=60,
                      json={"model": "default", "messages": LONG, "max_tokens": 20})
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "worker_error"
    ok = httpx.post(proxy.url + "/v1/chat/completions", timeout=60,
                    json={"model": "default", "messages": LONG, "max_tokens": 3})
    assert ok.status_code == 200


async def test_client_disconnect_aborts_the_worker_request(worker, proxy):
    assert _wait_idle(worker.url) == []
    body = {"model": "default", "messages": LONG, "max_tokens": 400, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(proxy.url + "/v1/chat/completions", json=body)
        chunks = 0
        async for line in resp.content:
            if line.startswith(b"data: "):
                chunks += 1
            if chunks == 4:
                break
        assert await asyncio.to_thread(_running, worker.url) != []  # it was running
        resp.close()  # drop the connection mid-stream
    assert await asyncio.to_thread(_wait_idle, worker.url) == []


def test_a_stop_string_ends_the_worker_request(worker, proxy):
    assert _wait_idle(worker.url) == []
    resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": LONG, "max_tokens": 2000, "temperature": 0, "stop": ["5"]})
    assert resp.status_code == 200
    assert "5" not in resp.json()["choices"][0]["message"]["content"]
    # without the abort the worker would still be decoding its 2000 tokens for a minute
    assert _wait_idle(worker.url, timeout_s=15) == []
