"""Errors: one exception type, one table of kinds, one middleware, two wire formats.

Every failure a client can see becomes an error object with the status from `KINDS`:
OpenAI's `{"error": {"message", "type", "code", "param"}}`, or on the Anthropic routes
(`/v1/messages...`) Anthropic's `{"type": "error", "error": {"type", "message"}}`, its type
following the status (`ANTHROPIC_TYPES`). Nothing else leaves the proxy as a 5xx traceback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

log = logging.getLogger("anchorcache.proxy")

# kind → (HTTP status, OpenAI error type)
KINDS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "invalid_json": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "unauthorized": (401, "authentication_error"),
    "invalid_api_key": (401, "authentication_error"),
    "permission_denied": (403, "permission_error"),
    "conflict": (409, "invalid_request_error"),
    "rate_limit_exceeded": (429, "rate_limit_error"),
    "quota_exceeded": (429, "rate_limit_error"),
    "not_found": (404, "invalid_request_error"),
    "model_not_found": (404, "invalid_request_error"),
    # /v1/responses: a previous_response_id this tenant did not store (or that expired)
    "previous_response_not_found": (404, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
    "overloaded": (503, "server_error"),
    "worker_unavailable": (503, "server_error"),
    "worker_error": (502, "server_error"),
    "internal_error": (500, "server_error"),
}


ANTHROPIC_PREFIX = "/v1/messages"
# HTTP status → Anthropic error type (https://docs.anthropic.com/en/api/errors); any other
# 4xx is invalid_request_error, any other 5xx api_error
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error",
                   529: "overloaded_error"}


def anthropic_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """An Anthropic error object; the offending field leads the message, as Anthropic's do."""
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error",
            "error": {"type": kind, "message": f"{param}: {message}" if param else message}}


class ApiError(Exception):
    def __init__(self, kind: str, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        assert kind in KINDS, kind
        self.kind = kind
        self.message = message
        self.param = param

    @property
    def status(self) -> int:
        return KINDS[self.kind][0]

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": KINDS[self.kind][1],
                          "code": self.kind, "param": self.param}}

    def anthropic_body(self) -> dict[str, Any]:
        return anthropic_body(self.status, self.message, self.param)


def json_response(data: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers=headers)


class EventStream(web.StreamResponse):
    """A `text/event-stream` response written a group of events at a time: its headers go
    out with the first group (as aiohttp's own `Response` sends them with its body), each
    `send` is one write, `end` the last one with the stream's end. One send(2) per group,
    not per event: a streamed turn's opening events and first delta go out together, its
    closing events with the end."""

    _send_headers_immediately = False  # (aiohttp's: `Response` sets it so too)

    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__(headers={"Content-Type": "text/event-stream",
                                  "Cache-Control": "no-cache", **headers})

    async def send(self, events: Iterable[bytes]) -> None:
        data = b"".join(events)
        if data:
            await self.write(data)

    async def end(self, events: Iterable[bytes] = ()) -> None:
        await self.write_eof(b"".join(events))


def error_response(err: ApiError, *, anthropic: bool = False) -> web.Response:
    return json_response(err.anthropic_body() if anthropic else err.body(), err.status)


_HTTP_KINDS = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    anthropic = request.path.startswith(ANTHROPIC_PREFIX)
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e, anthropic=anthropic)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = _HTTP_KINDS.get(e.status, "invalid_request" if e.status < 500 else "internal_error")
        message = e.reason if e.status != 413 else e.text
        if anthropic:
            return json_response(anthropic_body(e.status, message or ""), e.status)
        return json_response({"error": {"message": message, "type": KINDS[kind][1],
                                        "code": kind, "param": None}}, e.status)
    except (HttpProcessingError, web.RequestPayloadError) as e:  # e.g. gzip that is not gzip
        return error_response(ApiError("invalid_request",
                                       f"the request body could not be read: {e}"),
                              anthropic=anthropic)
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client went away (a reply cut mid-write): aiohttp drops it quietly
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError("internal_error", "internal error in the proxy"),
                              anthropic=anthropic)
