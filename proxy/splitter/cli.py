"""`anchorcache split`: show how a request splits (adapter, ids, every verified cut)."""

from __future__ import annotations

import json
import sys

from anchorcache.proxy.tokenizers import load_tokenizer

from .registry import get_adapter


def run_split(model: str | None, adapter: str, request_path: str) -> dict:
    """Load the tokenizer, split the request JSON at `request_path` ("-": stdin), and return
    `{"adapter", "model", "num_tokens", "input_ids", "cuts": [{"kind", "position"}]}`.

    Raises `SplitError` for a bad request, ValueError for an unknown model or adapter."""
    raw = sys.stdin.read() if request_path == "-" else open(request_path, encoding="utf-8").read()
    request = json.loads(raw)
    tokenizer = load_tokenizer(model)
    result = get_adapter(adapter, tokenizer).split(
        request.get("messages"), request.get("tools"),
        template_kwargs=request.get("chat_template_kwargs"))
    return {"model": tokenizer.name, **result.to_json()}
