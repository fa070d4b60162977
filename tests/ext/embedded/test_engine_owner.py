"""The embedded worker's anchor store has one owner, its engine thread: the contract's
admin calls are queued onto it (ext/embedded/backend.py), never run on the HTTP side.

A real worker app (tiny dense Qwen3) in this process, so every use of the store and its
slot table can be seen: they are wrapped to record the thread they run on."""

from __future__ import annotations

import asyncio
import functools
import random
import threading
from typing import Any

import pytest

from anchorcache.ext.embedded.app import WorkerConfig, create_app, load_engine
from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir
from anchorcache.wire import AnchorKind, AnchorPlan, GenerateRequest, SamplingParams, SnapshotSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded():
    model = build_tiny_model("qwen3", tiny_model_dir("qwen3"))
    return load_engine(WorkerConfig(model=str(model), anchor_slots=32, pinned_slots=4))


NS = bytes(range(16))
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def watch(obj: Any, seen: set[str]) -> None:
    """Record the thread of every call of `obj`'s public methods."""
    for name in dir(obj):
        attr = getattr(obj, name)
        if name.startswith("__") or not callable(attr):
            continue

        def wrapped(*args: Any, _fn: Any = attr, **kwargs: Any) -> Any:
            seen.add(threading.current_thread().name)
            return _fn(*args, **kwargs)

        setattr(obj, name, functools.wraps(attr)(wrapped))


def prompt(seed: int, n: int = 96) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 100000) for _ in range(n)]


def body(ids: list[int], plan: AnchorPlan | None = None) -> dict[str, Any]:
    return GenerateRequest(input_ids=tuple(ids), sampling=GREEDY, anchor=plan).to_json()


async def test_admin_calls_during_generation_run_on_the_engine_thread(aiohttp_client, loaded):
    engine, info = loaded
    seen: set[str] = set()
    assert engine.anchors is not None
    watch(engine.anchors.table, seen)
    watch(engine.anchors, seen)
    client = await aiohttp_client(create_app(WorkerConfig(), engine=engine, info=info))

    async def post(path: str, data: Any) -> Any:
        resp = await client.post(path, json=data)
        assert resp.status == 200, await resp.text()
        return await resp.json()

    prompts = [prompt(i) for i in range(6)]
    cold = [(await post("/generate", body(ids)))["output_ids"] for ids in prompts]

    # a committed anchor for the admin calls to pin, look up and list
    kept = await post("/generate", body(prompt(99), AnchorPlan(NS, snapshot=(
        SnapshotSpec(64, AnchorKind.INSTRUCTION),))))
    [w] = kept["meta_info"]["anchors"]["written"]
    assert (await post("/anchor/confirm", {"slots": [w["slot"]]}))["confirmed"] == [w["slot"]]

    done = asyncio.Event()
    calls = 0

    async def hammer() -> None:
        nonlocal calls
        while not done.is_set():
            await post("/anchor/pin", {"key": w["key"]})
            await post("/anchor/lookup", {"namespace": NS.hex(), "input_ids": prompt(99),
                                          "depths": [32, 64]})
            slots = (await client.get("/anchor/slots")).status
            stats = await (await client.get("/anchor/stats")).json()
            assert slots == 200 and stats["used_slots"] >= 1
            await post("/anchor/unpin", {"key": w["key"]})
            await post("/anchor/confirm", {"slots": []})
            await post("/anchor/abort", {"slots": []})
            calls += 1

    async def run(ids: list[int], depth: int) -> Any:
        return await post("/generate", body(ids, AnchorPlan(NS, snapshot=(
            SnapshotSpec(depth, AnchorKind.CONVERSATION),), chunk_at=(depth,))))

    hammers = [asyncio.create_task(hammer()) for _ in range(3)]
    try:
        warm = await asyncio.gather(*(run(ids, 48 + i) for i, ids in enumerate(prompts)))
    finally:
        done.set()
        await asyncio.gather(*hammers)
    assert calls >= 3
    assert [out["output_ids"] for out in warm] == cold  # admin calls change no output
    written = [out["meta_info"]["anchors"]["written"] for out in warm]
    assert [[x["depth"] for x in ws] for ws in written] == [[48 + i] for i in range(6)]
    confirmed = await post("/anchor/confirm", {"slots": [ws[0]["slot"] for ws in written]})
    assert sorted(confirmed["confirmed"]) == sorted(ws[0]["slot"] for ws in written)
    stats = await (await client.get("/anchor/stats")).json()
    assert (stats["used_slots"], stats["reserved_slots"], stats["staged"]) == (7, 0, 0)
    slots = (await (await client.get("/anchor/slots")).json())["slots"]
    assert sorted(s["depth"] for s in slots if s["state"] == "committed") == \
        sorted([64, *(48 + i for i in range(6))])
    assert not any(s["pinned"] for s in slots)
    assert (await post("/anchor/flush", {}))["flushed_anchors"] == 7
    assert seen == {"anchorcache-engine"}
