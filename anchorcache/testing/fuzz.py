"""One driver for the proxy's fuzz tests: hypothesis-made bodies posted to one route of an
in-process proxy (aiohttp's test client), each reply checked, the statuses counted.

Hypothesis drives a plain function, so the cases run in a thread and their requests on the
test's own event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings

Case = tuple[bytes, dict[str, str]]
# the fuzz tests' settings (each sets its own max_examples): derandomized, so a run in CI
# draws what a run here drew
FUZZ = settings(max_examples=250, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


def deep_schema(levels: int) -> Any:
    """A JSON schema (or tool input) nested `levels` deep (the body limit is 64)."""
    value: Any = {"type": "string"}
    for _ in range(levels):
        value = {"type": "object", "properties": {"x": value}}
    return value


async def fuzz_route(client: Any, path: str, cases: Any, fuzz: Any,
                     check: Callable[[int, bytes, bytes], None]) -> dict[int, int]:
    """POST every body `cases` (a strategy of (body, headers)) draws to `path` under the
    hypothesis settings `fuzz`; `check(status, reply, body)` raises on a reply that is wrong (a 5xx is wrong
    everywhere, checked here first). How many replies of each status came back."""
    loop = asyncio.get_running_loop()
    seen: dict[int, int] = {}

    async def post(data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        resp = await client.post(path, data=data, headers=headers)
        return resp.status, await resp.read()

    @fuzz
    @given(cases)
    def one(case: Case) -> None:
        data, headers = case
        status, raw = asyncio.run_coroutine_threadsafe(post(data, headers), loop).result(120)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (status, raw[:500], data[:300])
        check(status, raw, data)

    await asyncio.to_thread(one)
    return seen
