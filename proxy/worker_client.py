"""The proxy's side of the worker contract (docs/worker-protocol.md), over aiohttp.

Transport failures become `ApiError`s: the worker unreachable → 503 `worker_unavailable`,
the worker answering an error, dying mid-reply or not answering in time → 502
`worker_error`, and a 4xx from the worker is passed on as the client's bad request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson
from msgspec.structs import replace

from anchorcache.wire import (
    ConfirmReply,
    GenerateMeta,
    GenerateRequest,
    ImportReply,
    ModelInfo,
    SlotsReply,
    StopReply,
    WireError,
    WorkerHealth,
    encode,
    from_json,
)

from .errors import ApiError

T = TypeVar("T")

# a well worker answers /health at once; a hung one must not hang the proxy's /health
HEALTH_TIMEOUT_S = 10.0
SLAB_TIMEOUT_S = 120.0  # one slab file out of or into a disk tier
MAX_EVENT_BYTES = 64 << 20  # one event line of a generate reply (its meta: anchors, logprobs)


class ProgressClock:
    """How long the worker has sent nothing for the generate requests the proxy holds.

    `anchorcache serve` restarts a worker that holds requests past a deadline with no
    progress (anchorcache/supervise.py). Progress is any byte of any held reply arriving
    (read from the reply streams' byte counts, so a client that reads its stream slowly
    does not make the worker look stuck), or a request finishing; the clock starts when
    the proxy goes from holding no request to holding one. A request that ends without
    finishing (an error, a client gone) is no progress.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._streams: dict[int, tuple[Any, int]] = {}  # held request → (its reply stream, bytes seen)
        self._ids = itertools.count()
        self._since = clock()

    def begin(self) -> int:
        if not self._streams:
            self._since = self._clock()
        token = next(self._ids)
        self._streams[token] = (None, 0)
        return token

    def attach(self, token: int, stream: Any) -> None:
        """The reply stream (`aiohttp.StreamReader`) of held request `token`."""
        # not progress by itself: a live HTTP side sends headers for a wedged engine too
        self._streams[token] = (stream, 0)

    def end(self, token: int, *, finished: bool) -> None:
        self._streams.pop(token, None)
        if finished:
            self._since = self._clock()

    def stalled_s(self) -> float | None:
        """Seconds without progress; None while the proxy holds no generate request."""
        if not self._streams:
            return None
        now = self._clock()
        for token, (stream, seen) in list(self._streams.items()):
            total = getattr(stream, "total_bytes", 0) if stream is not None else 0
            if total != seen:
                self._streams[token] = (stream, total)
                self._since = now
        return now - self._since


TopLogprobs = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class Chunk:
    """A piece of a generate reply: new output ids, and on a sample's last one its meta info.
    `index` is the sample (n > 1); `logprobs`, when asked for, has one (logprob, top) per id."""

    output_ids: tuple[int, ...]
    meta: GenerateMeta | None = None
    index: int = 0
    logprobs: tuple[tuple[float, TopLogprobs], ...] | None = None


def _logprobs(event: dict[str, Any]) -> tuple[tuple[float, TopLogprobs], ...] | None:
    """SGLang's `output_token_logprobs` / `output_top_logprobs` ([logprob, id, text])."""
    tokens = event.get("output_token_logprobs")
    if tokens is None:
        return None
    tops = event.get("output_top_logprobs") or [[] for _ in tokens]
    return tuple((float(lp), tuple((int(t[1]), float(t[0])) for t in top))
                 for (lp, *_), top in zip(tokens, tops, strict=True))


async def _line_batches(content: aiohttp.StreamReader) -> AsyncGenerator[list[bytes], None]:
    """The whole lines of each read of `content`, a list a read (the last line at the end
    even without its newline); a line over `MAX_EVENT_BYTES` is a `worker_error`."""
    pending = bytearray()  # what arrived after the last whole line
    async for data in content.iter_any():
        pending += data
        end = pending.rfind(b"\n")
        if end < 0:
            if len(pending) > MAX_EVENT_BYTES:
                raise ApiError("worker_error", f"worker sent an event over {MAX_EVENT_BYTES} "
                                               "bytes")
            continue
        lines = bytes(pending[:end]).split(b"\n")
        del pending[:end + 1]
        yield lines
    if pending:
        yield [bytes(pending)]


def _worker_error(status: int, body: bytes) -> ApiError:
    try:
        err = orjson.loads(body)["error"]
        message = err.get("message", "")
    except Exception:
        err, message = {}, body[:200].decode(errors="replace")
    if 400 <= status < 500:
        kind = "context_length_exceeded" if "context" in message else "invalid_request"
        return ApiError(kind, message)
    return ApiError("worker_error", f"worker error ({status}): {message}")


class WorkerClient:
    """`on_epoch`: the one observer of the worker's epoch (the anchor life cycle sets it).
    Every reply that carries an epoch passes it there as it is parsed (health, slot listing,
    confirm, a generate reply's meta info), so no caller watches for restarts itself."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.progress = ProgressClock()
        self.on_epoch: Callable[[str], None] | None = None

    def _saw(self, epoch: str) -> None:
        if epoch and self.on_epoch is not None:
            self.on_epoch(epoch)

    async def _call(self, method: str, path: str, body: Any = None,
                    timeout_s: float | None = None, *, file: bytes | None = None,
                    file_reply: bool = False) -> Any:
        """The JSON reply of `path` (`body`: a JSON body; `file`: a slab file's bytes instead;
        `file_reply`: the reply's bytes, not parsed)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        content_type = "application/octet-stream" if file is not None else "application/json"
        try:
            async with self.session.request(
                    method, self.base_url + path,
                    data=file if file is not None else
                    orjson.dumps(body) if body is not None else None,
                    headers={"Content-Type": content_type}, timeout=timeout) as resp:
                data = await resp.read()
                if resp.status >= 400:
                    raise _worker_error(resp.status, data)
                return data if file_reply else orjson.loads(data)
        except aiohttp.ClientConnectorError as e:
            raise ApiError("worker_unavailable", f"worker unreachable: {e}") from None
        except (aiohttp.ClientError, orjson.JSONDecodeError) as e:
            raise ApiError("worker_error", f"worker failed: {type(e).__name__}: {e}") from None
        except asyncio.TimeoutError:
            raise ApiError("worker_error", f"worker did not answer {path} in time") from None

    async def model_info(self) -> ModelInfo:
        return await self._typed(ModelInfo, "GET", "/model_info")

    async def _typed(self, record: type[T], method: str, path: str, body: Any = None,
                     timeout_s: float | None = None, *, file: bytes | None = None) -> T:
        data = await self._call(method, path, body, timeout_s, file=file)
        try:
            return from_json(record, data)
        except WireError as e:
            raise ApiError("worker_error", f"malformed reply from {path}: {e}") from None

    async def health(self) -> WorkerHealth:
        reply = await self._typed(WorkerHealth, "GET", "/health", timeout_s=HEALTH_TIMEOUT_S)
        self._saw(reply.epoch)
        return reply

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_request", {"rid": rid})

    async def stop(self, rid: str, output_tokens: int | None) -> bool:
        """End request `rid` as a stop, its anchors kept (the response anchor: prompt +
        `output_tokens` output ids); its stream then ends with its meta as usual. False when
        the worker no longer runs it (its reply is on its way)."""
        reply = await self._typed(StopReply, "POST", "/stop_request",
                                  {"rid": rid, "output_tokens": output_tokens})
        return reply.stopped

    async def confirm(self, slots: list[int], rid: str, epoch: str) -> ConfirmReply:
        """Make the anchors request `rid` staged in `slots`, in the worker's `epoch`, visible;
        the reply names those confirmed and the keys evicted."""
        reply = await self._typed(ConfirmReply, "POST", "/anchor/confirm",
                                  {"slots": slots, "rid": rid, "epoch": epoch})
        self._saw(reply.epoch)
        return reply

    async def export_slab(self, key: bytes) -> bytes:
        """The anchor's slab file from the worker's disk tier (ApiError `not_found` when it
        holds none)."""
        return await self._call("POST", "/anchor/export", {"key": key.hex()},
                                SLAB_TIMEOUT_S, file_reply=True)

    async def import_slab(self, data: bytes) -> ImportReply:
        """A slab file (another worker's `export_slab`) onto the worker's disk tier."""
        reply = await self._typed(ImportReply, "POST", "/anchor/import", None, SLAB_TIMEOUT_S,
                                  file=data)
        self._saw(reply.epoch)
        return reply

    async def abort_slots(self, slots: list[int]) -> list[int]:
        reply = await self._call("POST", "/anchor/abort", {"slots": slots})
        return [int(s) for s in reply.get("aborted", [])]

    async def slots(self) -> SlotsReply:
        reply = await self._typed(SlotsReply, "GET", "/anchor/slots")
        self._saw(reply.epoch)
        return reply

    async def stats(self) -> dict[str, Any]:
        """The worker's slot-table counters, passed on as they are (for display)."""
        return dict(await self._call("GET", "/anchor/stats"))

    async def _key_op(self, path: str, field: str, key: bytes, **extra: Any) -> bool:
        return bool((await self._call("POST", path, {"key": key.hex(), **extra})).get(field))

    async def pin(self, key: bytes, cache_key: str | None) -> bool:
        """Pin anchor `key`; with a `cache_key` (the engine cache key of the namespace whose
        requests it serves) the worker may also keep its prefix on the device for them,
        without one it is pinned in the host tier only."""
        return await self._key_op("/anchor/pin", "pinned", key, cache_key=cache_key,
                                  device=cache_key is not None)

    async def unpin(self, key: bytes) -> bool:
        return await self._key_op("/anchor/unpin", "unpinned", key)

    async def evict(self, key: bytes) -> bool:
        return await self._key_op("/anchor/evict", "evicted", key)

    def _chunks(self, lines: list[bytes]) -> tuple[list[Chunk], bool, ApiError | None]:
        """The chunks of event lines that arrived together, whether `[DONE]` ended them, and
        the worker's error event that did: consecutive chunks of one sample merged into one
        (up to its last, with the meta), so that a proxy that falls behind the worker catches
        up by the batch, not by the token. (The tokens before an error event are chunks
        still: an error that arrives with the first token fails the request after it, as
        one that arrives later does.)"""
        out: list[Chunk] = []
        for line in lines:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                return out, True, None
            event = orjson.loads(payload)
            if not isinstance(event, dict):
                raise ApiError("worker_error", "worker sent an event that is not an object")
            if "error" in event:
                error = event["error"]
                message = error.get("message", "") if isinstance(error, dict) else error
                return out, True, ApiError("worker_error", f"worker error: {str(message)[:500]}")
            raw = event.get("meta_info")
            try:
                meta = from_json(GenerateMeta, raw) if raw is not None else None
            except WireError as e:
                raise ApiError("worker_error", f"malformed meta_info: {e}") from None
            if meta is not None:
                self._saw(meta.epoch)
            ids = tuple(event.get("output_ids", ()))
            if not all(type(t) is int for t in ids):
                raise ApiError("worker_error", "worker sent output ids that are not integers")
            chunk = Chunk(ids, meta, int(event.get("index", 0)), _logprobs(event))
            last = out[-1] if out else None
            if last is not None and last.meta is None and last.index == chunk.index \
                    and (last.logprobs is None) == (chunk.logprobs is None):
                out[-1] = Chunk(last.output_ids + chunk.output_ids, meta, chunk.index,
                                None if last.logprobs is None or chunk.logprobs is None
                                else last.logprobs + chunk.logprobs)
            else:
                out.append(chunk)
        return out, False, None

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """Stream a generate request's chunks; the last one carries `meta`.

        A worker that ends the stream without a final chunk raises `worker_error`.
        """
        body = encode(req if req.stream else replace(req, stream=True))
        held = self.progress.begin()
        finished = False
        try:
            async with self.session.post(self.base_url + "/generate", data=body,
                                         headers={"Content-Type": "application/json"}) as resp:
                self.progress.attach(held, resp.content)
                if resp.status >= 400:
                    raise _worker_error(resp.status, await resp.read())
                async with contextlib.aclosing(_line_batches(resp.content)) as batches:
                    async for lines in batches:
                        chunks, done, failed = self._chunks(lines)
                        for chunk in chunks:
                            yield chunk
                            finished = finished or chunk.meta is not None
                        if failed is not None:
                            raise failed
                        if done:
                            break
                if not finished:
                    raise ApiError("worker_error", "worker ended the stream without finishing")
        except aiohttp.ClientConnectorError as e:
            raise ApiError("worker_unavailable", f"worker unreachable: {e}") from None
        except (aiohttp.ClientError, orjson.JSONDecodeError, ValueError, TypeError) as e:
            raise ApiError("worker_error", f"worker failed mid-request: {type(e).__name__}: {e}") from None
        except asyncio.TimeoutError:
            raise ApiError("worker_error", "worker did not finish the request in time") from None
        finally:
            self.progress.end(held, finished=finished)
