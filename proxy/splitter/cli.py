"""`anchorcache split`: show how a request splits (adapter, ids, every verified cut)."""

from __future__ import annotations

import json
import sys

from .registry import get_adapter
from .tokenizers import load_tokenizer


def run_split(model: str | None, adapter: str, request_path: str, *,
              canonical_tools: bool = False) -> dict:
    """Load the tokenizer, split the request JSON at `request_path` ("-": stdin), and return
    `{"model", "adapter", "deviation", "num_tokens", "input_ids", "cuts": [{"kind",
    "position"}]}`; `deviation` says where the render deliberately differs from the model's
    own chat template (null: byte-identical).

    Raises `SplitError` for a bad request, ValueError for an unknown model or adapter."""
    raw = sys.stdin.read() if request_path == "-" else open(request_path, encoding="utf-8").read()
    request = json.loads(raw)
    tokenizer = load_tokenizer(model)
    chosen = get_adapter(adapter, tokenizer, canonical_tools=canonical_tools)
    result = chosen.split(request.get("messages"), request.get("tools"),
                          template_kwargs=request.get("chat_template_kwargs"))
    out = result.to_json()
    deviation = chosen.deviation
    if canonical_tools and request.get("tools"):
        note = "tools in canonical order (--canonical-tools), not the client's"
        deviation = f"{deviation}; {note}" if deviation else note
    return {"model": tokenizer.name, "adapter": out.pop("adapter"), "deviation": deviation,
            **out}
