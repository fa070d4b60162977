"""How the proxy reads a generate reply's event stream (proxy/worker_client.py
`WorkerClient.generate`): events that arrive together are merged into one chunk per sample,
whatever the byte boundaries the stream arrives in.

The worker here is an aiohttp server that writes a prepared SSE stream in chosen pieces,
each sent and flushed before the next: the one way to put the network's cuts at every byte
of an event (a real worker's cuts are wherever its writes and the kernel put them)."""

from __future__ import annotations

import asyncio
import itertools
import random

import aiohttp
import orjson
import pytest
from aiohttp import web

from anchorcache import wire
from anchorcache.proxy import worker_client
from anchorcache.proxy.errors import ApiError
from anchorcache.proxy.worker_client import WorkerClient

EPOCH = "e" * 32


def meta(index: int | None = None, completion_tokens: int = 3) -> dict:
    return wire.to_json(wire.GenerateMeta(
        epoch=EPOCH, prompt_tokens=5, completion_tokens=completion_tokens, cached_tokens=0,
        prefill_tokens=5, finish_reason=wire.FinishStop(7), anchors=wire.AnchorReport(),
        restore_ms=0.0, prefill_ms=0.0, decode_ms=0.0, rid="r1", index=index))


def event(body: dict) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def tokens(ids: list[int], index: int = 0, logprobs: bool = False) -> bytes:
    body: dict = {"output_ids": ids, "index": index}
    if logprobs:
        body["output_token_logprobs"] = [[-0.5 * t, t, None] for t in ids]
    return event(body)


async def read(aiohttp_server, pieces: list[bytes]) -> list[worker_client.Chunk]:
    """The chunks `WorkerClient.generate` makes of a reply sent as `pieces`."""
    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
            await asyncio.sleep(0.005)  # each piece its own read on the proxy's side
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as session:
        client = WorkerClient(session, str(server.make_url("")))
        req = wire.GenerateRequest(input_ids=(1, 2, 3), rid="r1")
        return [c async for c in client.generate(req)]


def cut(stream: bytes, at: list[int]) -> list[bytes]:
    bounds = [0, *sorted(at), len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds) if b > a]


async def test_events_cut_at_any_byte_give_the_same_ids_and_meta(aiohttp_server):
    stream = b"".join([tokens([11]), tokens([12, 13]), tokens([14]),
                       event({"output_ids": [15], "index": 0, "meta_info": meta()}),
                       b"data: [DONE]\n\n"])
    rng = random.Random(5)
    for at in ([], [1], [3, 6, 9], [len(stream) - 1], rng.sample(range(1, len(stream)), 12),
               list(range(1, len(stream)))):  # the last: every byte its own piece
        chunks = await read(aiohttp_server, cut(stream, at))
        assert [t for c in chunks for t in c.output_ids] == [11, 12, 13, 14, 15]
        assert [c.meta is not None for c in chunks][-1] and all(c.meta is None for c in chunks[:-1])
        assert chunks[-1].meta.completion_tokens == 3


async def test_events_that_arrive_together_are_one_chunk(aiohttp_server):
    together = tokens([1]) + tokens([2]) + tokens([3])
    chunks = await read(aiohttp_server, [together, tokens([4]),
                                         event({"output_ids": [], "meta_info": meta()})])
    # (a reader that falls further behind merges more: the later pieces may join)
    assert chunks[0].output_ids[:3] == (1, 2, 3)
    assert [t for c in chunks for t in c.output_ids] == [1, 2, 3, 4]
    assert chunks[-1].meta is not None
    # the meta merged with tokens that came with it
    chunks = await read(aiohttp_server, [tokens([1]) + tokens([2]) + event(
        {"output_ids": [3], "meta_info": meta()}) + b"data: [DONE]\n\n"])
    assert [(c.output_ids, c.meta is not None) for c in chunks] == [((1, 2, 3), True)]


async def test_samples_are_merged_apart_and_each_ends_with_its_meta(aiohttp_server):
    stream = [tokens([1], 0) + tokens([2], 1) + tokens([3], 1) + tokens([4], 0),
              event({"output_ids": [5], "index": 1, "meta_info": meta(1)})
              + tokens([6], 0) + event({"output_ids": [], "index": 0, "meta_info": meta(0)}),
              b"data: [DONE]\n\n"]
    chunks = await read(aiohttp_server, stream)
    assert [(c.index, c.output_ids, c.meta is not None) for c in chunks] == [
        (0, (1,), False), (1, (2, 3), False), (0, (4,), False), (1, (5,), True),
        (0, (6,), True)]


async def test_logprobs_stay_with_their_ids(aiohttp_server):
    chunks = await read(aiohttp_server, [tokens([3, 4], logprobs=True) + tokens([5], logprobs=True)
                                         + event({"output_ids": [], "meta_info": meta()})])
    ids = [t for c in chunks for t in c.output_ids]
    lps = [lp for c in chunks for lp, _ in (c.logprobs or ())]
    assert ids == [3, 4, 5] and lps == [-1.5, -2.0, -2.5]


async def test_a_last_line_without_a_newline_is_read(aiohttp_server):
    chunks = await read(aiohttp_server, [tokens([1]), b"data: " + orjson.dumps(
        {"output_ids": [2], "meta_info": meta()})])
    assert [t for c in chunks for t in c.output_ids] == [1, 2] and chunks[-1].meta is not None


async def test_a_stream_without_its_meta_or_with_an_error_is_a_worker_error(aiohttp_server):
    with pytest.raises(ApiError) as e:
        await read(aiohttp_server, [tokens([1]), b"data: [DONE]\n\n"])
    assert e.value.kind == "worker_error" and "without finishing" in e.value.message
    with pytest.raises(ApiError) as e:
        await read(aiohttp_server, [tokens([1]) + event({"error": {"message": "engine died"}})])
    assert e.value.kind == "worker_error" and "engine died" in e.value.message
    for bad in (b"data: {not json\n\n", b"data: [1, 2]\n\n", b'data: {"error": "oom"}\n\n',
                b'data: {"output_ids": ["a"]}\n\n', b'data: {"output_ids": 5}\n\n',
                b'data: {"output_ids": [1], "index": "x"}\n\n'):
        with pytest.raises(ApiError) as e:
            await read(aiohttp_server, [tokens([1]) + bad])
        assert e.value.kind == "worker_error", bad


async def test_an_endless_line_is_refused(aiohttp_server, monkeypatch):
    monkeypatch.setattr(worker_client, "MAX_EVENT_BYTES", 1000)
    with pytest.raises(ApiError) as e:
        await read(aiohttp_server, [b"data: {\"output_ids\": [" + b"1," * 300,
                                    b"1," * 300, b"1]}\n\n"])
    assert e.value.kind == "worker_error" and "over 1000 bytes" in e.value.message
