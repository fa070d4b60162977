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
