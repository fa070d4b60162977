"""Sixteen identical new requests sent at once; one prefills, the other fifteen
restore what it wrote, though all sixteen were planned before any anchor existed (the
worker looks anchors up again when a queued request starts: ext/held_chain.py)."""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest

pytestmark = pytest.mark.slow


async def test_sixteen_identical_new_requests_prefill_once(proxy):
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="", max_retries=0,
                                timeout=300)
    messages = [{"role": "system", "content": f"You are a terse assistant. Session {uuid.uuid4()}."},
                {"role": "user", "content": "Name the largest planet of the solar system."}]
    replies = await asyncio.gather(*[client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=8) for _ in range(16)])
    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in replies)
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    assert len(set(cached[1:])) == 1  # all restored the same (deepest) anchor
    assert cached[1] < replies[0].usage.prompt_tokens
    assert len({r.choices[0].message.content for r in replies}) == 1  # token-identical outputs
    await client.close()
