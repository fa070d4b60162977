"""The proxy's side of the disk tier (docs/disk-tier.md): a restarted worker comes back warm
in the proxy's view (reconcile recovers the anchors its disk lists, each for the tenant it was
recorded for), a pinned toolset is pinned from disk rather than prefilled, a worker sharing
another's directory imports its files on a miss, and `/metrics` shows the disk figures.

The ledger's recovery on a real SQLite file first (milliseconds), then real embedded workers
SIGKILLed and started again on the same port and directory behind a real proxy."""

from __future__ import annotations

import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from anchorcache.cli import free_port
from anchorcache.state.ledger import Ledger
from anchorcache.state.records import AnchorStatus, HeldSlot, NewAnchor
from anchorcache.testing.data import conversations
from anchorcache.testing.servers import (
    ADMIN,
    Server,
    proxy_process,
    tenant_key,
    worker_process,
)

W1, W2, E1, E2 = "http://w1", "http://w2", "e1", "e2"
NS_A, NS_B = bytes(16), bytes([1]) * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def new(i: int, depth: int, parent: int | None = None) -> NewAnchor:
    return NewAnchor(key(i), depth, key(parent) if parent else None, i, 10 * depth,
                     "instruction" if parent is None else "conversation")


def disk(i: int, depth: int, parent: int | None = None) -> HeldSlot:
    """A listing entry of the disk tier: no slot."""
    return HeldSlot(None, key(i), depth, key(parent) if parent else None, 10 * depth)


@pytest.fixture()
def ledger(tmp_path):
    led = Ledger.open(tmp_path / "state")
    led.ensure_tenant("a")
    led.ensure_tenant("b")
    yield led
    led.close()


def committed(led: Ledger, i: int, *, worker: str = W1, epoch: str = E1, ns: bytes = NS_A,
              tenant: str = "a", depth: int = 10, parent: int | None = None) -> None:
    led.record_written(f"r{i}-{worker}-{epoch}", worker, epoch, ns, tenant,
                       [new(i, depth, parent)])
    led.commit(worker, epoch, [key(i)])


def test_a_new_epoch_recovers_the_listed_disk_anchors_each_for_its_own_tenant(ledger):
    committed(ledger, 1, depth=10)  # tenant a's chain
    committed(ledger, 2, depth=30, parent=1)
    committed(ledger, 3, ns=NS_B, tenant="b", depth=10)  # tenant b's
    report = ledger.reconcile(W1, E2, [disk(1, 10), disk(2, 30, 1), disk(3, 10),
                                       disk(9, 10)])  # 9: a key the ledger never saw
    assert report.recovered == 3 and report.lost == 3
    rows = {r.key: r for r in ledger.anchors(worker=W1, epoch=E2)}
    assert set(rows) == {key(1), key(2), key(3)}
    assert {k: (r.tenant, r.namespace, r.status, r.slot) for k, r in rows.items()} == {
        key(1): ("a", NS_A, AnchorStatus.COMMITTED, None),
        key(2): ("a", NS_A, AnchorStatus.COMMITTED, None),
        key(3): ("b", NS_B, AnchorStatus.COMMITTED, None)}
    assert rows[key(2)].parent == key(1) and rows[key(1)].kind == "instruction"
    assert ledger.anchors(tenant="b", epoch=E2) == [rows[key(3)]]
    # listed again at the same epoch: kept, not recovered twice; memory slots replace None
    again = ledger.reconcile(W1, E2, [HeldSlot(5, key(1), 10, None, 100), disk(2, 30, 1),
                                      disk(3, 10)])
    assert (again.recovered, again.kept) == (0, 3)
    assert ledger.anchors(worker=W1, epoch=E2, key=key(1))[0].slot == 5


def test_a_listing_never_recovers_a_key_for_a_tenant_that_is_not_unambiguously_its_owner(
        ledger):
    committed(ledger, 1, depth=10)
    # the same key recorded for two tenants (keys bind the namespace, so only a bug could do
    # this): nothing says whose it is, so it is not recovered for either
    committed(ledger, 1, worker=W2, ns=NS_B, tenant="b", depth=10)
    committed(ledger, 4, depth=12)
    report = ledger.reconcile(W1, E2, [disk(1, 10), disk(4, 13)])  # 4 at another depth
    assert report.recovered == 0 and ledger.anchors(worker=W1, epoch=E2) == []


def test_a_worker_sharing_another_ones_directory_recovers_its_anchors(ledger):
    committed(ledger, 1, depth=10)
    committed(ledger, 2, depth=20, parent=1, worker=W1)
    report = ledger.reconcile(W2, E2, [disk(1, 10), disk(2, 20, 1)])
    assert report.recovered == 2
    assert {(r.key, r.tenant, r.namespace) for r in ledger.anchors(worker=W2, epoch=E2)} == \
        {(key(1), "a", NS_A), (key(2), "a", NS_A)}
    assert len(ledger.anchors(worker=W1, epoch=E1)) == 2  # W1's own rows are left alone


# ---- real workers behind a real proxy ----------------------------------------------------------

SYSTEM = [{"role": "system", "content": "You are a careful file-system assistant."}]


def tools() -> list[dict[str, Any]]:
    return sorted(conversations("base"), key=lambda c: len(str(c)))[0]["tools"][:2]


def ask(proxy: Server, messages: list[dict[str, Any]], api_key: str | None = None
        ) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.post(proxy.url + "/v1/chat/completions", headers=headers, timeout=300, json={
        "model": "default", "messages": messages, "tools": tools(), "temperature": 0,
        "max_tokens": 6})
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def admin(proxy: Server, path: str, **params: Any) -> Any:
    resp = httpx.get(proxy.url + path, headers=ADMIN, params=params, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def wait_for(what: str, check: Any, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.5)
    raise AssertionError(what)


def slab_names(directory: Path) -> set[tuple[str, int]]:
    return {(f.name.split("-")[0], int(f.stem.split("-")[1])) for f in directory.glob("*/*.slab")}


def owners(proxy: Server) -> dict[tuple[str, int], str]:
    """(key, depth) → tenant of every committed anchor at the worker's current epoch."""
    rows = admin(proxy, "/admin/anchors")["data"]
    return {(r["key"], r["depth"]): r["tenant"] for r in rows}


@pytest.mark.slow
def test_a_restarted_worker_is_warm_in_the_proxys_view_and_its_pinned_toolset_loads_from_disk(
        default_model_dir, tmp_path):
    port = free_port()
    disk_dir = tmp_path / "disk"
    env = {"ANCHORCACHE_ANCHOR_DISK_DIR": str(disk_dir)}
    state_dir = tmp_path / "state"
    with worker_process(model=str(default_model_dir), port=port, env=env) as w1, \
            proxy_process(w1.url, state_dir=str(state_dir)) as proxy, \
            proxy_process(w1.url, "--no-anchors") as ref:
        alpha, beta = tenant_key(proxy, "alpha"), tenant_key(proxy, "beta")
        turn1 = [*SYSTEM, {"role": "user", "content": "List the files."}]
        first = {t: ask(proxy, turn1, k) for t, k in (("alpha", alpha), ("beta", beta))}
        made = httpx.post(proxy.url + "/admin/tenants/alpha/toolsets", headers=ADMIN,
                          timeout=300, json={"messages": SYSTEM, "tools": tools(), "pin": True})
        assert made.status_code == 200, made.text
        toolset = made.json()
        before = owners(proxy)
        # the same prompt in two tenants: two namespaces, no key in common
        assert {"alpha", "beta"} == set(before.values())
        wait_for("every confirmed anchor on disk", lambda: set(before) <= slab_names(disk_dir))
        old_epoch = admin(proxy, "/admin/stats")["epoch"]
        w1.kill()
        restarted_at = time.time()
        with worker_process(model=str(default_model_dir), port=port, env=env) as w2:
            # reconcile recovers every anchor the new worker lists from its disk, for the
            # tenant it was recorded for, before any request ran on the new worker
            after = wait_for("anchors recovered under the new epoch", lambda: (
                admin(proxy, "/admin/stats")["epoch"] != old_epoch and owners(proxy)))
            assert after == before
            slots = wait_for("the pinned toolset pinned on the new worker", lambda: [
                s for s in httpx.get(w2.url + "/anchor/slots", timeout=30).json()["slots"]
                if s["key"] == toolset["toolset"] and s["pinned"]])
            assert slots[0]["tier"] == "host"
            disk = httpx.get(w2.url + "/anchor/stats", timeout=30).json()["disk"]
            assert disk["loads"] >= 1 and disk["skips"] == 0, disk
            # ... loaded from disk, not prefilled: no warm-up request since the restart
            with sqlite3.connect(state_dir / "ledger.sqlite3") as db:
                warmups = db.execute("SELECT count(*) FROM reservations WHERE rid LIKE 'warm-%' "
                                     "AND opened_at >= ?", [restarted_at]).fetchone()[0]
            assert warmups == 0
            # the next turn of each tenant restores its own anchors, planned by the proxy,
            # with the anchors-off output
            for tenant, api_key in (("alpha", alpha), ("beta", beta)):
                reply = first[tenant]
                turn2 = [*turn1, {"role": "assistant",
                                  "content": reply["choices"][0]["message"]["content"] or "ok"},
                         {"role": "user", "content": "And the hidden ones?"}]
                warm = ask(proxy, turn2, api_key)
                assert cached(warm) >= 0.9 * reply["usage"]["prompt_tokens"], warm["usage"]
                assert warm["choices"][0]["message"] == ask(ref, turn2)["choices"][0]["message"]
                hits = {h["depth"] for h in warm["usage"]["timings"]["anchor_hits"]}
                mine = {d for (_, d), t in after.items() if t == tenant}
                assert hits and hits <= mine | {d for (_, d), t in owners(proxy).items()
                                                if t == tenant}
            # /metrics shows the workers' disk figures
            text = httpx.get(proxy.url + "/metrics", timeout=30).text
            for name in ("disk_bytes", "disk_files", "disk_loads", "disk_skips"):
                assert f"anchorcache_worker_{name}" in text, name
            loads = [line for line in text.splitlines()
                     if line.startswith("anchorcache_worker_disk_loads_total{")]
            assert loads and float(loads[0].split()[-1]) >= 1, loads


@pytest.mark.slow
def test_a_replica_sharing_the_directory_imports_files_and_never_restores_a_misnamed_one(
        default_model_dir, tmp_path):
    """Two workers of one model on one directory; the second, started before the first wrote
    anything (its index is empty), joins the proxy and the first leaves. Tenant alpha's next
    turn restores the first's files, imported on the miss (a stat of the exact name). Tenant
    beta's files were all overwritten with a copy of one of alpha's (another key's file under
    beta's names): each is refused when the miss finds it, nothing of beta's is restored and
    its output is the anchors-off one. Then a third worker, on a directory of its own, is added
    warm from the second (the proxy copies its files over the contract) and serves alpha's
    turn from them."""
    env = {"ANCHORCACHE_ANCHOR_DISK_DIR": str(tmp_path / "disk")}
    with worker_process(model=str(default_model_dir), env=env) as w1, \
            worker_process(model=str(default_model_dir), env=env) as w2, \
            proxy_process(w1.url, state_dir=str(tmp_path / "state")) as proxy, \
            proxy_process(w2.url, "--no-anchors") as ref:
        alpha, beta = tenant_key(proxy, "alpha"), tenant_key(proxy, "beta")
        turn1 = [*SYSTEM, {"role": "user", "content": "List the files."}]
        first = {t: ask(proxy, turn1, k) for t, k in (("alpha", alpha), ("beta", beta))}
        written = owners(proxy)
        wait_for("w1's files", lambda: set(written) <= slab_names(tmp_path / "disk"))
        assert httpx.get(w2.url + "/anchor/slots", timeout=30).json()["disk"] == []
        folder = next((tmp_path / "disk").glob("*-tp0of1"))
        alphas = sorted((d, k) for (k, d), t in written.items() if t == "alpha")
        decoy = folder / f"{alphas[-1][1]}-{alphas[-1][0]}.slab"
        betas = [(k, d) for (k, d), t in written.items() if t == "beta"]
        for k, d in betas:
            shutil.copy(decoy, folder / f"{k}-{d}.slab")

        added = httpx.post(proxy.url + "/admin/workers", headers=ADMIN, json={"url": w2.url},
                           timeout=300)
        assert added.status_code == 200, added.text
        first_worker = next(w["name"] for w in admin(proxy, "/admin/workers")["data"]
                            if w["url"].rstrip("/") == w1.url)
        gone = httpx.delete(proxy.url + "/admin/workers/" + first_worker, headers=ADMIN,
                            timeout=300)
        assert gone.status_code == 200, gone.text

        reply = first["alpha"]
        turn2 = [*turn1, {"role": "assistant",
                          "content": reply["choices"][0]["message"]["content"] or "ok"},
                 {"role": "user", "content": "And the hidden ones?"}]
        warm = ask(proxy, turn2, alpha)
        assert cached(warm) > 0, warm["usage"]
        assert warm["choices"][0]["message"] == ask(ref, turn2)["choices"][0]["message"]
        stats = httpx.get(w2.url + "/anchor/stats", timeout=30).json()["disk"]
        assert stats["imports"] >= 1 and stats["loads"] >= 1 and stats["skips"] == 0, stats

        cold = ask(proxy, turn1, beta)
        assert cached(cold) == 0, cold["usage"]
        assert cold["choices"][0]["message"] == ask(ref, turn1)["choices"][0]["message"]
        after = httpx.get(w2.url + "/anchor/stats", timeout=30).json()["disk"]
        assert after["skips"] >= 1 and after["loads"] == stats["loads"], (stats, after)

        # a replica with a directory of its own joins warm: the proxy copies the serving
        # worker's files into it over the contract (`/anchor/export`, `/anchor/import`,
        # parents first) as it is added; a damaged file is refused with a 400, not kept
        with worker_process(model=str(default_model_dir), env={
                "ANCHORCACHE_ANCHOR_DISK_DIR": str(tmp_path / "disk3")}) as w3:
            slab = httpx.post(w1.url + "/anchor/export", json={"key": alphas[0][1]}, timeout=60)
            assert slab.status_code == 200, slab.text
            damaged = bytearray(slab.content)
            damaged[-5] ^= 1
            refused = httpx.post(w3.url + "/anchor/import", content=bytes(damaged), timeout=60)
            assert refused.status_code == 400, refused.text
            assert "checksum" in refused.json()["error"]["message"]
            assert httpx.get(w3.url + "/anchor/slots", timeout=30).json()["disk"] == []

            second = next(w["name"] for w in admin(proxy, "/admin/workers")["data"]
                          if w["url"].rstrip("/") == w2.url)
            added = httpx.post(proxy.url + "/admin/workers", headers=ADMIN, timeout=300,
                               json={"url": w3.url, "warm_from": second})
            assert added.status_code == 200, added.text
            warmed = added.json()["warmed"][added.json()["name"]]
            assert warmed["copied"] >= 1 and warmed["refused"] == 0, warmed
            listed = {(x["key"], x["depth"])
                      for x in httpx.get(w3.url + "/anchor/slots", timeout=30).json()["disk"]}
            assert len(listed) == warmed["copied"], (listed, warmed)
            assert listed & {(k, d) for d, k in alphas}, listed  # alpha's first turn is there
            assert httpx.delete(proxy.url + "/admin/workers/" + second, headers=ADMIN,
                                timeout=300).status_code == 200
            moved = ask(proxy, turn2, alpha)
            assert cached(moved) > 0, moved["usage"]
            assert moved["choices"][0]["message"] == warm["choices"][0]["message"]
            w3_disk = httpx.get(w3.url + "/anchor/stats", timeout=30).json()["disk"]
            assert w3_disk["imports"] == warmed["copied"] and w3_disk["skips"] == 1, w3_disk
            assert w3_disk["loads"] >= 1, w3_disk


@pytest.mark.slow
def test_a_pinned_toolset_whose_file_is_damaged_is_prefilled_and_pinned_after_all(
        default_model_dir, tmp_path):
    port = free_port()
    disk_dir = tmp_path / "disk"
    env = {"ANCHORCACHE_ANCHOR_DISK_DIR": str(disk_dir)}
    state_dir = tmp_path / "state"
    with worker_process(model=str(default_model_dir), port=port, env=env) as w1, \
            proxy_process(w1.url, state_dir=str(state_dir)) as proxy:
        tenant_key(proxy, "alpha")
        made = httpx.post(proxy.url + "/admin/tenants/alpha/toolsets", headers=ADMIN,
                          timeout=300, json={"messages": SYSTEM, "tools": tools(), "pin": True})
        assert made.status_code == 200, made.text
        toolset = made.json()
        name = (toolset["toolset"], toolset["anchor"]["depth"])
        wait_for("the toolset's file", lambda: name in slab_names(disk_dir))
        old_epoch = admin(proxy, "/admin/stats")["epoch"]
        w1.kill()
        path = next(disk_dir.glob(f"*/{name[0]}-{name[1]}.slab"))
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF  # the payload: the header still reads, the checksum fails at load
        path.write_bytes(bytes(data))
        restarted_at = time.time()
        with worker_process(model=str(default_model_dir), port=port, env=env) as w2:
            wait_for("the pinned toolset pinned on the new worker", lambda: (
                admin(proxy, "/admin/stats")["epoch"] != old_epoch and [
                    s for s in httpx.get(w2.url + "/anchor/slots", timeout=30).json()["slots"]
                    if s["key"] == toolset["toolset"] and s["pinned"]]))
            disk = httpx.get(w2.url + "/anchor/stats", timeout=30).json()["disk"]
            assert disk["skips"] >= 1, disk
            with sqlite3.connect(state_dir / "ledger.sqlite3") as db:
                warmups = db.execute("SELECT count(*) FROM reservations WHERE rid LIKE 'warm-%' "
                                     "AND opened_at >= ? AND outcome = 'confirmed'",
                                     [restarted_at]).fetchone()[0]
            assert warmups == 1
