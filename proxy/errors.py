"""OpenAI-style errors: one exception type, one table of kinds, one middleware.

Every failure a client can see becomes `{"error": {"message", "type", "code", "param"}}`
with the status from `KINDS`; nothing else leaves the proxy as a 5xx traceback.
"""

from __future__ import annotations

import asyncio
import logging
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
    "not_found": (404, "invalid_request_error"),
    "model_not_found": (404, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
    "overloaded": (503, "server_error"),
    "worker_unavailable": (503, "server_error"),
    "worker_error": (502, "server_error"),
    "internal_error": (500, "server_error"),
}


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


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(err: ApiError) -> web.Response:
    return json_response(err.body(), err.status)


_HTTP_KINDS = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = _HTTP_KINDS.get(e.status, "invalid_request" if e.status < 500 else "internal_error")
        return json_response({"error": {"message": e.reason if e.status != 413 else e.text,
                                        "type": KINDS[kind][1], "code": kind, "param": None}},
                             e.status)
    except (HttpProcessingError, web.RequestPayloadError) as e:  # e.g. gzip that is not gzip
        return error_response(ApiError("invalid_request",
                                       f"the request body could not be read: {e}"))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError("internal_error", "internal error in the proxy"))
