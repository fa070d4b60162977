"""Fixtures of the proxy's tests: the proxy in process (aiohttp's test client), in front of
the session's real default worker."""

from __future__ import annotations

import pytest

from anchorcache.proxy.app import create_app
from anchorcache.proxy.config import ProxyConfig
from anchorcache.testing.servers import ADMIN_TOKEN


@pytest.fixture()
async def client(aiohttp_client, worker, tmp_path):
    """A proxy of the default configuration (admin API on), its ledger in `tmp_path`; a
    module that needs another configuration defines its own `client`."""
    return await aiohttp_client(create_app(ProxyConfig(
        worker_urls=(worker.url,), state_dir=str(tmp_path), admin_token=ADMIN_TOKEN)))


@pytest.fixture()
async def refusing_client(aiohttp_client, worker, tmp_path):
    """A proxy for the fuzz tests: one token unless a body says otherwise, and a max_tokens
    past the context refused, not clamped, so a valid body generates a token or two, never
    the context's worth (the clamp: tests/proxy/test_agent_bodies.py)."""
    return await aiohttp_client(create_app(ProxyConfig(
        worker_urls=(worker.url,), default_max_tokens=1, state_dir=str(tmp_path),
        admin_token=ADMIN_TOKEN, max_tokens_policy="refuse")))
