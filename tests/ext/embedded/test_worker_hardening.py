"""The embedded worker against hostile or unlucky input, on a real worker with a
tiny hybrid model: malformed input is a 4xx, never a 500; a queued request restores what
the request ahead of it just wrote (late lookup), and never anything it must not."""

from __future__ import annotations

import asyncio
import gzip
import json
import random

import httpx
import pytest

from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir
from anchorcache.testing.servers import worker_process
from anchorcache.wire import (
    AnchorKind,
    AnchorPlan,
    GenerateRequest,
    Region,
    SamplingParams,
    SnapshotSpec,
)

pytestmark = pytest.mark.slow

NS = bytes(range(16))
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def worker():
    model = build_tiny_model("qwen3_next", tiny_model_dir("qwen3_next"))
    with worker_process(model=str(model)) as server:
        server.info = httpx.get(server.url + "/model_info").json()
        server.config = json.loads((model / "config.json").read_text())
        yield server


def body(ids, plan=None, sampling=GREEDY):
    return GenerateRequest(input_ids=tuple(ids), sampling=sampling, anchor=plan).to_json()


def generate(worker, ids, plan=None, sampling=GREEDY):
    resp = httpx.post(worker.url + "/generate", json=body(ids, plan, sampling), timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def prompt(seed, n=240):
    rng = random.Random(seed)
    return [rng.randrange(1000, 100000) for _ in range(n)]


def snapshots(*depths, ns=NS):
    return AnchorPlan(ns, snapshot=tuple(SnapshotSpec(d, AnchorKind.CONVERSATION, Region.THICK)
                                         for d in depths), chunk_at=tuple(depths))


def assert_400(resp):
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


# ---- malformed input is a 4xx ---------------------------------------------------------

def test_model_info_reports_the_vocabulary(worker):
    """The model's own vocabulary size, and its last id is a valid input (the next one, a 400
    below, is the first outside it)."""
    assert worker.info["vocab_size"] == worker.config["vocab_size"]
    last = worker.info["vocab_size"] - 1
    out = generate(worker, [1, 2, last], sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
    assert len(out["output_ids"]) == 1


@pytest.mark.parametrize("bad", ["vocab", "negative", "int64"])
def test_input_ids_outside_the_vocabulary_are_400(worker, bad):
    token = {"vocab": worker.info["vocab_size"], "negative": -1, "int64": 1 << 64}[bad]
    for stream in (False, True):
        resp = httpx.post(worker.url + "/generate", timeout=60,
                          json={"input_ids": [1, 2, token], "stream": stream})
        assert_400(resp)
        assert "input_ids" in resp.json()["error"]["message"]
    look = httpx.post(worker.url + "/anchor/lookup", timeout=60,
                      json={"namespace": NS.hex(), "input_ids": [1, 1 << 64], "depths": [1]})
    assert_400(look)


@pytest.mark.parametrize("route", ["/anchor/pin", "/anchor/unpin", "/anchor/evict",
                                   "/anchor/export"])
@pytest.mark.parametrize("key", ["00" * 15, "00" * 17, "", 5, ["00"]])
def test_a_key_of_the_wrong_length_is_400(worker, route, key):
    assert_400(httpx.post(worker.url + route, json={"key": key}, timeout=30))


def test_moving_files_without_a_disk_tier_is_409_in_the_contracts_shape(worker):
    assert httpx.get(worker.url + "/anchor/stats", timeout=30).json()["disk"] is None
    for resp in (httpx.post(worker.url + "/anchor/import", content=b"\x00" * 64, timeout=30),
                 httpx.post(worker.url + "/anchor/export", json={"key": "00" * 16}, timeout=30)):
        assert resp.status_code == 409, resp.text
        assert "disk tier" in resp.json()["error"]["message"]


def test_gzip_content_encoding_with_a_plain_body_is_400(worker):
    plain = httpx.post(worker.url + "/generate", content=b'{"input_ids": [1, 2]}', timeout=60,
                       headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert_400(plain)
    real = httpx.post(worker.url + "/generate", timeout=60,
                      content=gzip.compress(b'{"input_ids": [1, 2], "sampling_params": '
                                            b'{"max_new_tokens": 1}}'),
                      headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert real.status_code == 200, real.text


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-6])
def test_a_near_zero_temperature_samples_greedily(worker, temperature):
    ids = prompt(1, 40)
    greedy = generate(worker, ids)["output_ids"]
    # sent as it is (a SamplingParams built here would already hold 0.0)
    tiny = {"max_new_tokens": 6, "temperature": temperature, "seed": 3}
    resp = httpx.post(worker.url + "/generate", timeout=120,
                      json={"input_ids": ids, "sampling_params": tiny})
    assert resp.status_code == 200, resp.text
    assert resp.json()["output_ids"] == greedy


@pytest.mark.parametrize("params", [{"temperature": -1}, {"top_p": 1.5}, {"top_k": -2},
                                    {"seed": 1 << 64}, {"max_new_tokens": -1},
                                    {"temperature": "hot"}])
def test_bad_sampling_params_are_400(worker, params):
    assert_400(httpx.post(worker.url + "/generate", timeout=30,
                          json={"input_ids": [1, 2], "sampling_params": params}))


# ---- late lookup ------------------------------------------------------------------------

async def _generate_all(worker, bodies):
    async with httpx.AsyncClient(timeout=300) as client:
        replies = await asyncio.gather(*[client.post(worker.url + "/generate", json=b)
                                         for b in bodies])
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json() for r in replies]


async def test_queued_identical_requests_restore_what_the_first_one_wrote(worker):
    ids = prompt(10)
    cold = generate(worker, ids, AnchorPlan(NS, chunk_at=(90, 180)))["output_ids"]
    replies = await _generate_all(worker, [body(ids, snapshots(90, 180)) for _ in range(4)])
    cached = sorted(r["meta_info"]["cached_tokens"] for r in replies)
    assert cached == [0, 180, 180, 180]
    assert all(r["output_ids"] == cold for r in replies)
    for r in replies:
        anchors = r["meta_info"]["anchors"]
        if r["meta_info"]["cached_tokens"]:
            assert anchors["late_lookup"] is True
            assert [a["depth"] for a in anchors["restored"]] == [90, 180]
            assert anchors["written"] == []  # nothing left to write past 180


def test_a_committed_chain_is_found_without_being_planned(worker):
    ids = prompt(11)
    written = generate(worker, ids[:200], snapshots(70, 150))["meta_info"]["anchors"]["written"]
    httpx.post(worker.url + "/anchor/confirm", json={"slots": [w["slot"] for w in written]}
               ).raise_for_status()
    cold = generate(worker, ids, AnchorPlan(NS, chunk_at=(70, 150)))["output_ids"]
    warm = generate(worker, ids, snapshots(70, 150))
    assert warm["meta_info"]["cached_tokens"] == 150
    assert warm["output_ids"] == cold
    hits = httpx.get(worker.url + "/anchor/slots").json()["slots"]
    assert {s["depth"]: s["hits"] for s in hits if s["key"] in {w["key"] for w in written}} \
        == {70: 1, 150: 1}


def test_a_shared_prefix_restores_only_the_shared_cut(worker):
    a = prompt(12)
    b = a[:100] + prompt(13, 140)
    generate(worker, a, snapshots(100, 200))  # staged, finished
    out = generate(worker, b, snapshots(100, 200))
    assert out["meta_info"]["cached_tokens"] == 100
    assert out["output_ids"] == generate(worker, b, AnchorPlan(NS, chunk_at=(100, 200)))["output_ids"]


def test_another_namespace_never_restores_them(worker):
    ids = prompt(14)
    generate(worker, ids, snapshots(100))
    other = generate(worker, ids, snapshots(100, ns=bytes(16)))
    assert other["meta_info"]["cached_tokens"] == 0


def test_snapshots_of_a_failed_request_are_never_restored(worker):
    ids = prompt(15)
    httpx.post(worker.url + "/debug/fault", json={"where": "decode"}).raise_for_status()
    failed = httpx.post(worker.url + "/generate", json=body(ids, snapshots(120)), timeout=120)
    assert failed.status_code == 500  # the injected fault
    out = generate(worker, ids, snapshots(120))
    assert out["meta_info"]["cached_tokens"] == 0
    assert [w["depth"] for w in out["meta_info"]["anchors"]["written"]] == [120]


def test_anchors_off_plans_restore_nothing(worker):
    ids = prompt(16)
    generate(worker, ids, snapshots(100))
    out = generate(worker, ids, AnchorPlan(b"", chunk_at=(100,)))  # the proxy's anchors-off plan
    assert out["meta_info"]["cached_tokens"] == 0
