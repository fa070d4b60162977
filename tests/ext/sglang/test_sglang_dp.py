"""SGLang's data parallelism (`--dp-size 2`): each rank is a worker of its own under
`/dp/K`, and the proxy routes to the ranks as to separate workers.

One real SGLang server on CPU (tiny Qwen3, two DP ranks, one core each: the CPU recipe sets
SGLANG_CPU_OMP_THREADS_BIND for dp x tp ranks), shared by the module. Checked:
- the root lists the ranks, each rank has its own epoch, and the root refuses anchor calls
  (no call may land on a rank it is not meant for);
- a request sent to a rank runs there: an anchor written on rank 1 is held in rank 1's memory
  only, restores exactly on rank 1 after the device was flushed, and on rank 0 from the
  file rank 1 wrote (the ranks share the disk tier's directory, as workers on shared
  storage do);
- the proxy makes each rank a target: conversations keep to their rank, turn 2 restores its
  history there, outputs equal an anchors-off proxy's, the ledger records each anchor under
  its rank and that rank's epoch; a rank drained and added back live;
- the disk tier after a restart: both ranks list an anchor one of them wrote and restore it;
  each rank keeps half the worker's byte budget.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from anchorcache.testing.data import conversations, turn_requests, two_turn_prompts
from anchorcache.testing.servers import (
    ADMIN,
    Server,
    admin,
    ask,
    proxy_process,
    sglang_worker_process,
)
from anchorcache.testing.worker_api import NS, flush_device, generate, post, save, verify
from anchorcache.wire import AnchorKind, AnchorPlan, AnchorRef, Region

pytestmark = pytest.mark.slow

DISK_BYTES = 1 << 26  # the worker's disk budget: each rank keeps half


@pytest.fixture(scope="module")
def dp_disk(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dp-disk")


def _dp_server(model: str, disk: Path) -> Any:
    return sglang_worker_process("--dp-size", "2", model=model,
                                 env={"ANCHORCACHE_ANCHOR_DISK_DIR": str(disk),
                                      "ANCHORCACHE_ANCHOR_DISK_BYTES": str(DISK_BYTES)})


@pytest.fixture(scope="module")
def sglang_dp(tiny_qwen3, dp_disk) -> Iterator[Server]:
    with _dp_server(str(tiny_qwen3), dp_disk) as server:
        yield server


def _slab_file(disk: Path, key: bytes, depth: int) -> Path:
    """The anchor's file, once the writer thread wrote it (the ranks share one folder)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = list(disk.glob(f"*-tp0of1/{key.hex()}-{depth}.slab"))
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no file of {key.hex()} at {depth}: {sorted(disk.rglob('*'))}")


def _disk_loads(url: str) -> int:
    return int(httpx.get(url + "/anchor/stats", timeout=60).json()["disk"]["loads"])


def test_each_rank_is_a_worker_with_its_own_anchors(sglang_dp, dp_disk, qwen3_tokenizer):
    root = sglang_dp.url
    info = httpx.get(root + "/model_info", timeout=60).json()
    assert info["ranks"] == ["dp/0", "dp/1"]
    rank0, rank1 = (f"{root}/{r}" for r in info["ranks"])
    epochs = [httpx.get(u + "/model_info", timeout=60).json()["epoch"] for u in (rank0, rank1)]
    assert epochs[0] != epochs[1] and info["epoch"] == ",".join(epochs)
    assert not httpx.get(rank1 + "/model_info", timeout=60).json().get("ranks")  # a rank has none
    for path in ("/generate", "/anchor/confirm", "/anchor/slots", "/flush_cache"):
        refused = httpx.request("GET" if path == "/anchor/slots" else "POST", root + path,
                                json={}, timeout=60)
        assert refused.status_code == 409 and "/dp/0, /dp/1" in refused.text, refused.text

    _, depth, p1, p2 = two_turn_prompts(qwen3_tokenizer, 1)[0]
    keys, _ = save(rank1, p1, [(depth, AnchorKind.CONVERSATION, Region.THICK)])
    key = keys[depth]
    listed = {u: {s["key"] for s in httpx.get(u + "/anchor/slots", timeout=60).json()["slots"]}
              for u in (rank0, rank1)}
    assert key.hex() in listed[rank1] and key.hex() not in listed[rank0]
    flush_device(rank1)  # SGLang's flush empties every rank's tree; the host anchors stay
    cold = generate(rank0, p2)
    assert cold["meta_info"]["cached_tokens"] == 0
    # rank 0 does not hold the anchor in memory: asked to restore it, it reads the file rank
    # 1 wrote (the ranks share the disk tier's directory); rank 1 restores it from memory
    _slab_file(dp_disk, key, depth)
    loads = [_disk_loads(u) for u in (rank0, rank1)]
    flush_device(rank0)
    plan = AnchorPlan(NS, restore=(AnchorRef(key, depth),))
    shared = generate(rank0, p2, plan)
    assert shared["meta_info"]["anchors"]["restored_tokens"] == depth
    assert shared["output_ids"] == cold["output_ids"]
    flush_device(rank0)
    warm = generate(rank1, p2, plan)
    assert warm["meta_info"]["cached_tokens"] == warm["meta_info"]["anchors"]["restored_tokens"] \
        == depth
    assert warm["output_ids"] == cold["output_ids"]
    assert [_disk_loads(u) for u in (rank0, rank1)] == [loads[0] + 1, loads[1]]
    check = verify(rank1, key)
    assert check["device_tokens"] == depth and check["mismatch"] is None, check
    # the prefix is now in rank 1's tree only: a plain request reuses it there, not on rank 0
    assert generate(rank1, p2)["meta_info"]["cached_tokens"] >= depth
    assert generate(rank0, p1)["meta_info"]["cached_tokens"] < depth
    post(rank0, "/anchor/flush")
    post(rank1, "/anchor/flush")


TOOLSETS = ("add_to_watchlist", "cat")  # the first tool of two BFCL toolsets


def traffic(n: int = 4, turns: int = 2) -> list[tuple[int, list[dict], list[dict]]]:
    """`n` BFCL conversations over two toolsets (alternating), every turn 1 then every turn 2."""
    by_toolset = [[c for c in sorted(conversations("base"), key=lambda c: len(str(c)))
                   if c["tools"][0]["function"]["name"] == name] for name in TOOLSETS]
    convs = [by_toolset[i % 2][i // 2] for i in range(n)]
    return [(i, turn_requests(convs[i], turns)[t], convs[i]["tools"][:3])
            for t in range(turns) for i in range(n)]


def test_the_proxy_routes_to_each_rank_as_a_worker(sglang_dp):
    root = sglang_dp.url
    requests = traffic()
    with proxy_process(root, "--no-anchors") as off:
        flush_device(root + "/dp/0")
        alone = [ask(off, m, t)[0] for _, m, t in requests]
    flush_device(root + "/dp/0")
    with proxy_process(root) as proxy:
        listed = admin(proxy, "/admin/workers")["data"]
        assert [(w["name"], w["url"]) for w in listed] == \
            [("w0", root + "/dp/0"), ("w1", root + "/dp/1")]
        assert listed[0]["epoch"] != listed[1]["epoch"]
        routed = [(conv, *ask(proxy, m, t)) for conv, m, t in requests]
        anchors = admin(proxy, "/admin/anchors")["data"]

        # rank 1 drained and added back live (a server's ranks that are not targets yet)
        assert admin(proxy, "/admin/workers/w1", "DELETE")["drained"]
        added = admin(proxy, "/admin/workers", "POST", json={"url": root})
        assert [t["url"] for t in added["targets"]] == [root + "/dp/1"]
        assert added["name"] == "w2" and added["healthy"]
        again = httpx.post(proxy.url + "/admin/workers", headers=ADMIN, json={"url": root})
        assert again.status_code == 409, again.text

    # outputs equal anchors off, token for token (greedy, one request at a time)
    assert [r["choices"][0]["message"] for _, r, _ in routed] == \
        [r["choices"][0]["message"] for r in alone]
    # one toolset per rank (equal loads: a new toolset goes to the rank routed fewer), and a
    # conversation's turn 2 goes where its turn 1 went and restores its history there
    n = len(requests) // 2
    home = {conv: worker for conv, _, worker in routed[:n]}
    assert home == {i: "w0" if i % 2 == 0 else "w1" for i in range(n)}
    for (conv, r, worker), (_, first, _) in zip(routed[n:], routed[:n], strict=True):
        assert worker == home[conv]
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
            first["usage"]["prompt_tokens"] - 8, (conv, r["usage"])
    # the ledger: each anchor under the rank that holds it, with that rank's epoch
    epochs = {w["url"]: w["epoch"] for w in listed}
    assert {a["worker"] for a in anchors} == set(epochs)
    assert all(a["epoch"] == epochs[a["worker"]] for a in anchors)


def test_the_ranks_share_the_disk_tier_and_come_back_warm(sglang_dp, tiny_qwen3, dp_disk,
                                                          qwen3_tokenizer):
    """Last in the module: it SIGKILLs the module's server."""
    root = sglang_dp.url
    rank0, rank1 = root + "/dp/0", root + "/dp/1"
    _, depth, p1, p2 = two_turn_prompts(qwen3_tokenizer, 3)[2]
    keys, _ = save(rank0, p1, [(depth, AnchorKind.CONVERSATION, Region.THICK)])
    key = keys[depth]
    flush_device(rank0)
    cold = generate(rank1, p2)["output_ids"]
    _slab_file(dp_disk, key, depth)
    for url in (rank0, rank1):
        disk = httpx.get(url + "/anchor/stats", timeout=60).json()["disk"]
        assert disk["budget_bytes"] == DISK_BYTES // 2, disk
    old = httpx.get(root + "/model_info", timeout=60).json()["epoch"]
    sglang_dp.kill()

    with _dp_server(str(tiny_qwen3), dp_disk) as again:
        root = again.url
        assert httpx.get(root + "/model_info", timeout=60).json()["epoch"] != old
        plan = AnchorPlan(NS, restore=(AnchorRef(key, depth),))
        for rank in ("dp/0", "dp/1"):
            url = f"{root}/{rank}"
            listed = httpx.get(url + "/anchor/slots", timeout=60).json()["disk"]
            assert (key.hex(), depth) in {(d["key"], d["depth"]) for d in listed}, rank
            flush_device(url)
            warm = generate(url, p2, plan)
            assert warm["meta_info"]["anchors"]["restored_tokens"] == depth, rank
            assert warm["meta_info"]["cached_tokens"] == depth
            assert warm["output_ids"] == cold
