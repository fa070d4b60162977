"""The worker contract's HTTP routes as raw JSON calls, for tests that drive a worker
directly (no proxy): generate with an anchor plan, snapshot and confirm, flush, verify.
Every call asserts a 200."""

from __future__ import annotations

from typing import Any

import httpx

from anchorcache.wire import AnchorPlan, GenerateRequest, SamplingParams, SnapshotSpec

# the tests' anchor namespace (a tenant's salt, as the proxy would send)
NS = bytes(range(16, 32))


def generate(url: str, ids: Any, plan: AnchorPlan | None = None, max_new: int = 6,
             logprobs: bool = False) -> dict[str, Any]:
    """Greedy generation of `max_new` tokens after `ids`, under `plan`."""
    req = GenerateRequest(input_ids=tuple(ids), anchor=plan, return_logprob=logprobs,
                          sampling=SamplingParams(max_new_tokens=max_new, temperature=0.0))
    resp = httpx.post(url + "/generate", json=req.to_json(), timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def post(url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    resp = httpx.post(url + path, json=body or {}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def flush_device(url: str) -> None:
    """Drop the engine's own device prefix cache (`/flush_cache`), so a hit can only come
    from an anchor restored out of the host tier."""
    post(url, "/flush_cache")


def snapshot_plan(*specs: tuple[int, Any, Any]) -> AnchorPlan:
    """A plan that snapshots at each (depth, kind, region) in `specs`, namespace `NS`."""
    return AnchorPlan(NS, snapshot=tuple(SnapshotSpec(d, k, r) for d, k, r in specs))


def save(url: str, ids: Any, specs: list[tuple[int, Any, Any]], max_new: int = 6
         ) -> tuple[dict[int, bytes], dict[str, Any]]:
    """Snapshot and confirm; ({depth: key} of the anchors written or already held, the
    generate reply)."""
    out = generate(url, ids, snapshot_plan(*specs), max_new=max_new)
    anchors = out["meta_info"]["anchors"]
    post(url, "/anchor/confirm", {"slots": [w["slot"] for w in anchors["written"]]})
    return {w["depth"]: bytes.fromhex(w["key"]) for w in anchors["written"] + anchors["held"]}, out


def verify(url: str, key: bytes) -> dict[str, Any]:
    """The worker's byte-for-byte comparison of the device rows its tree holds for the
    anchor `key`'s prefix with the anchor's host slabs."""
    return post(url, "/anchor/verify", {"key": key.hex()})
