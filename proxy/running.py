"""What a running proxy holds: config, the workers (targets, each with its client and anchor
life cycle, which alone holds its planner), the model's info and tokenizer, the splitter
(and the thread it runs on) and the ledger."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from anchorcache.state.ledger import Ledger
from anchorcache.wire import ModelInfo

from .config import ProxyConfig
from .metrics import ProxyMetrics
from .responses_items import MessagesMemo
from .split_pool import SplitPool, TokenBudget
from .splitter import Adapter
from .splitter.memo import ConversionMemos, MessageMemo
from .targets import Targets


@dataclass
class ProxyState:
    config: ProxyConfig
    targets: Targets  # the workers, routing and failover
    info: ModelInfo  # the model's (every target serves the same)
    tokenizer: Any
    adapter: Adapter
    splits: SplitPool  # render + tokenize, off the event loop
    budget: TokenBudget  # early refusal of text that cannot fit the context
    ledger: Ledger
    metrics: ProxyMetrics  # the same object as app[METRICS]
    # chat messages validated at the edge, per caller (splitter/memo.py)
    messages: MessageMemo = field(default_factory=MessageMemo)
    # Responses input items validated at the edge, per caller (responses_schema)
    responses: MessageMemo = field(default_factory=MessageMemo)
    # those items' chat messages, per caller (responses_items.MessagesMemo)
    responses_messages: MessagesMemo = field(default_factory=MessagesMemo)
    # Anthropic messages' shapes and conversions, per caller (anthropic_schema.Memos)
    anthropic: ConversionMemos = field(default_factory=ConversionMemos)
    # toolsets' grammar constraints, per caller (structured.build_constraint)
    constraints: MessageMemo = field(default_factory=MessageMemo)

    @property
    def anchors_on(self) -> bool:
        return self.config.anchors


STATE = web.AppKey("state", ProxyState)
