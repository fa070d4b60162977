"""`--served-model-name`: the names a request's `model` may give besides the served model's
id and "default", on every API (Claude Code sends its vendor's model names). In process, in
front of the session's real worker."""

from __future__ import annotations

import pytest

from anchorcache.proxy.app import create_app
from anchorcache.proxy.config import ProxyConfig

CLAUDE = "claude-sonnet-4-5-20250929"
USER = [{"role": "user", "content": "Say hi."}]


def _bodies(model: str) -> list[tuple[str, dict]]:
    return [("/v1/chat/completions", {"model": model, "messages": USER, "max_tokens": 2}),
            ("/v1/messages", {"model": model, "messages": USER, "max_tokens": 2}),
            ("/v1/responses", {"model": model, "input": "Say hi.", "max_output_tokens": 2}),
            ("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2})]


async def _proxy(aiohttp_client, worker, tmp_path, names):
    return await aiohttp_client(create_app(ProxyConfig(
        worker_urls=(worker.url,), state_dir=str(tmp_path), served_model_names=names)))


async def test_a_configured_name_is_served_and_another_is_a_404(aiohttp_client, worker,
                                                                 tmp_path):
    client = await _proxy(aiohttp_client, worker, tmp_path, (CLAUDE,))
    for path, body in _bodies(CLAUDE):
        resp = await client.post(path, json=body)
        assert resp.status == 200, (path, await resp.text())
    for path, body in _bodies("claude-opus-4-1"):
        resp = await client.post(path, json=body)
        assert resp.status == 404, (path, await resp.text())
        assert "claude-opus-4-1" in await resp.text()


@pytest.mark.parametrize("names", [(), ("*",)], ids=["default", "any"])
async def test_the_served_id_always_answers_and_star_answers_any(aiohttp_client, worker,
                                                                 tmp_path, names):
    client = await _proxy(aiohttp_client, worker, tmp_path, names)
    resp = await client.post("/v1/chat/completions", json=_bodies("default")[0][1])
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v1/chat/completions", json=_bodies("any-name-at-all")[0][1])
    assert resp.status == (200 if names else 404), await resp.text()
