"""The worker secret: a worker given one serves nothing but `/health` without it, and a
proxy given the same secret is served (a real tiny Qwen3 worker app in this process)."""

from __future__ import annotations

import pytest

from anchorcache.ext.embedded.app import WorkerConfig, create_app, load_engine
from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir
from anchorcache.wire import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow

SECRET = "worker-secret-0123456789"


@pytest.fixture(scope="module")
def loaded():
    model = build_tiny_model("qwen3", tiny_model_dir("qwen3"))
    return load_engine(WorkerConfig(model=str(model), anchor_slots=8, pinned_slots=2))


async def test_calls_without_the_secret_are_refused_and_health_answers(aiohttp_client, loaded):
    engine, info = loaded
    client = await aiohttp_client(create_app(WorkerConfig(secret=SECRET), engine=engine,
                                             info=info))
    generate = GenerateRequest(input_ids=(1, 2, 3),
                               sampling=SamplingParams(max_new_tokens=2, temperature=0.0))
    calls = [("POST", "/generate", generate.to_json()), ("POST", "/anchor/flush", {}),
             ("POST", "/flush_cache", {}), ("GET", "/anchor/slots", None),
             ("GET", "/model_info", None), ("POST", "/abort_request", {"rid": "x"}),
             ("POST", "/anchor/pin", {"key": "00" * 16}),
             ("POST", "/anchor/export", {"key": "00" * 16}), ("POST", "/anchor/import", {})]
    for headers in ({}, {"Authorization": "Bearer wrong-secret-0123456789"},
                    {"Authorization": SECRET}, {"Authorization": f"Basic {SECRET}"}):
        for method, path, body in calls:
            resp = await client.request(method, path, json=body, headers=headers)
            assert resp.status == 401, (path, headers)
            error = (await resp.json())["error"]
            assert error["type"] == "invalid_request_error" and "secret" in error["message"]
    assert (await client.get("/health")).status == 200  # probes need no secret
    auth = {"Authorization": f"Bearer {SECRET}"}
    resp = await client.post("/generate", json=generate.to_json(), headers=auth)
    assert resp.status == 200, await resp.text()
    assert len((await resp.json())["output_ids"]) == 2
    assert (await client.get("/anchor/slots", headers=auth)).status == 200
    assert (await client.post("/anchor/flush", json={}, headers=auth)).status == 200


def test_a_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 16 characters"):
        WorkerConfig(secret="short")
