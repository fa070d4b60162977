"""Chat-template adapters as the proxy's tests use them: the default model's adapter, its
split as the proxy's split thread offers it, messages as vLLM/SGLang hand them to a
template, and a harmony completion's tokens."""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from anchorcache.proxy.errors import ApiError
from anchorcache.proxy.splitter.types import SplitError


@functools.cache
def chatml_adapter() -> Any:
    """The default model's (SmolLM2, ChatML) adapter, loaded once."""
    from anchorcache.proxy.splitter import get_adapter
    from anchorcache.proxy.splitter.tokenizers import load_tokenizer

    return get_adapter("auto", load_tokenizer("smollm2"))


def split_fn(adapter: Any) -> Callable[..., Awaitable[Any]]:
    """The adapter's split as the proxy's split thread offers it (async, ApiError)."""
    async def split(messages: Any, tools: Any, template_kwargs: Any) -> Any:
        try:
            return adapter.split(messages, tools, template_kwargs=template_kwargs)
        except SplitError as e:
            raise ApiError("invalid_request", str(e)) from None
    return split


def template_input(messages: list[dict]) -> list[dict]:
    """Messages as vLLM/SGLang pass them to a chat template (independent of the splitter)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(
                    c["function"]["arguments"]) if isinstance(c["function"]["arguments"], str)
                    else c["function"]["arguments"]}} for c in m["tool_calls"]]
        out.append(m)
    return out


def harmony_completion(adapter: Any, *hmsgs: Any) -> tuple[list[int], str]:
    """Tokens a model would generate after `<|start|>assistant` (the harmony messages
    `hmsgs`, rendered by `adapter`'s o200k encoding), and their text."""
    enc = adapter.tokenizer.encoding
    ids = [t for m in hmsgs for t in enc.render(m)]
    start = enc.encode("<|start|>assistant", allowed_special="all")
    assert ids[: len(start)] == start
    return ids[len(start):], enc.decode(ids[len(start):])
