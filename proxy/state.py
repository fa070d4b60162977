"""What a running proxy holds: config, worker client and info, tokenizer, splitter (and the
thread it runs on), ledger and the anchor life cycle (which alone holds the planner)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from anchorcache.state.ledger import Ledger

from .config import ProxyConfig
from .lifecycle import AnchorLifecycle
from .split_pool import SplitPool, TokenBudget
from .splitter import Adapter
from .worker_client import WorkerClient, WorkerInfo

if TYPE_CHECKING:  # metrics.py reads STATE from here
    from .metrics import ProxyMetrics


@dataclass
class ProxyState:
    config: ProxyConfig
    worker: WorkerClient
    info: WorkerInfo
    tokenizer: Any
    adapter: Adapter
    splits: SplitPool  # render + tokenize, off the event loop
    budget: TokenBudget  # early refusal of text that cannot fit the context
    ledger: Ledger
    lifecycle: AnchorLifecycle  # the one owner of plan → generate → confirm/abort → record
    metrics: ProxyMetrics  # the same object as app[METRICS]

    @property
    def anchors_on(self) -> bool:
        return self.config.anchors


STATE = web.AppKey("state", ProxyState)
