"""The admin API's HTTP client: the only way `ops/` reaches the proxy (never by import).

Every failure becomes an `OpsError` with one line for people and an exit code that means
something (see `EXIT_CODES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

# exit code → meaning (also in `anchorcache ops --help`)
EXIT_CODES = {0: "ok", 1: "the proxy refused the request (4xx/5xx)", 3: "proxy unreachable",
              4: "admin token missing or wrong", 5: "not found"}


class OpsError(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


@dataclass(frozen=True)
class AdminClient:
    url: str
    token: str | None
    timeout_s: float = 600.0

    def request(self, method: str, path: str, *, json: Any = None,
                params: dict[str, Any] | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        params = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            resp = httpx.request(method, self.url.rstrip("/") + path, json=json, params=params,
                                 headers=headers, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise OpsError(f"cannot reach the proxy at {self.url}: {type(e).__name__}: {e}", 3) from None
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code >= 400:
            message = (body or {}).get("error", {}).get("message") if isinstance(body, dict) else None
            message = message or resp.text[:200] or resp.reason_phrase
            if resp.status_code in (401, 403):
                raise OpsError(f"admin API refused the token ({resp.status_code}): {message}", 4)
            if resp.status_code == 404:
                raise OpsError(f"not found: {message}", 5)
            raise OpsError(f"proxy answered {resp.status_code}: {message}", 1)
        return body

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json=body if body is not None else {})

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)
