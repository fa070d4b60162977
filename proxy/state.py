"""What a running proxy holds: config, worker client and info, tokenizer, splitter, planner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .config import ProxyConfig
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

    @property
    def anchors_on(self) -> bool:
        return self.config.anchors


STATE = web.AppKey("state", ProxyState)
