"""What a running proxy holds: config, worker client and info, tokenizer, splitter, planner,
ledger, the anchor life cycle and the tenants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from anchorcache.state.ledger import Ledger

from .config import ProxyConfig
from .lifecycle import AnchorLifecycle
from .planner import Planner
from .splitter import Adapter
from .worker_client import WorkerClient, WorkerInfo


@dataclass
class ProxyState:
    config: ProxyConfig
    worker: WorkerClient
    info: WorkerInfo
    tokenizer: Any
    adapter: Adapter
    planner: Planner
    ledger: Ledger
    lifecycle: AnchorLifecycle

    @property
    def anchors_on(self) -> bool:
        return self.config.anchors


STATE = web.AppKey("state", ProxyState)
