"""Anchors survive a proxy restart, and a worker restart loses them cleanly: worker and
proxy as separate processes, the proxy (one process or `--processes 2`, on one ledger in
turn) SIGKILLed at random points of a replay."""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from anchorcache.cli import free_port
from anchorcache.testing.data import conversations, turn_requests
from anchorcache.testing.servers import ADMIN, Server, proxy_process, worker_process

pytestmark = pytest.mark.slow

MAX_TOKENS = 6


def ask(proxy: Server, messages, tools) -> dict:
    resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=300, json={
        "model": "default", "messages": messages, "tools": tools, "temperature": 0,
        "max_tokens": MAX_TOKENS})
    assert resp.status_code == 200, resp.text
    return resp.json()


def admin(proxy: Server, path: str, **params) -> dict:
    resp = httpx.get(proxy.url + path, headers=ADMIN, params=params, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def worker(default_model_dir) -> Iterator[Server]:
    with worker_process(model=str(default_model_dir)) as server:
        yield server


@pytest.fixture(scope="module")
def off(worker) -> Iterator[Server]:
    with proxy_process(worker.url, "--no-anchors") as server:
        yield server


def convs(n: int):
    return sorted(conversations("base"), key=lambda c: len(str(c)))[:n]


def check_ledger_matches_worker(proxy: Server) -> None:
    """Nothing committed that the worker does not hold; no reservation open."""
    held = {(s["key"], s["depth"]) for s in admin(proxy, "/admin/slots")["data"]
            if s["state"] == "committed"}
    committed = admin(proxy, "/admin/anchors", status="committed")["data"]
    assert {(r["key"], r["depth"]) for r in committed} <= held
    reserved = admin(proxy, "/admin/anchors", status="reserved", epoch="all")["data"]
    assert reserved == []
    assert admin(proxy, "/admin/stats")["ledger"]["reservations"].get("open", 0) == 0


def test_sigkill_the_proxy_during_a_replay(worker, off, tmp_path):
    rng = random.Random(1)
    # three tools each: prompts of a few hundred tokens keep the replay quick
    replay = [(i, c["tools"][:3], turn_requests(c, 3)) for i, c in enumerate(convs(4))]
    done: dict[int, int] = {}  # conversation → turns completed before some kill
    errors: list[BaseException] = []  # anything but the kill itself, raised in the replay
    checked = 0
    port = free_port()
    for k in range(4):  # one proxy process, then two (every process killed), and again
        with proxy_process(worker.url, "--processes", str(1 + k % 2), state_dir=str(tmp_path),
                           port=port) as proxy:
            check_ledger_matches_worker(proxy)
            # a known conversation's next turn restores its history, with the same output
            for i, tools, turns in replay:
                if 0 < done.get(i, 0) < len(turns):
                    on, ref = ask(proxy, turns[done[i]], tools), ask(off, turns[done[i]], tools)
                    assert on["choices"][0]["message"] == ref["choices"][0]["message"]
                    assert cached(on) > 0
                    done[i] += 1
                    checked += 1

            def run() -> None:
                try:
                    for i, tools, turns in replay:
                        while done.get(i, 0) < len(turns):
                            ask(proxy, turns[done.get(i, 0)], tools)
                            done[i] = done.get(i, 0) + 1
                except httpx.HTTPError:
                    pass  # the proxy was killed under it
                except BaseException as e:
                    errors.append(e)

            # kill after 1-2 more replies, at a random point of the next request (or between)
            target = sum(done.values()) + rng.randint(1, 2)
            thread = threading.Thread(target=run)
            thread.start()
            while sum(done.values()) < target and thread.is_alive():
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 1.5))
            proxy.kill()
            thread.join(timeout=300)
            assert errors == []
    with proxy_process(worker.url, state_dir=str(tmp_path), port=port) as proxy:
        check_ledger_matches_worker(proxy)
        # a new conversation of a known toolset restores at least the instruction anchor
        assert checked > 0  # some conversation was picked up again after a kill
        i, tools, turns = next(r for r in replay if done.get(r[0], 0) > 0)
        fresh = [turns[0][0], {"role": "user", "content": "A new question on the same tools."}] \
            if turns[0][0]["role"] == "system" else [{"role": "user", "content": "A new question."}]
        on, ref = ask(proxy, fresh, tools), ask(off, fresh, tools)
        assert on["choices"][0]["message"] == ref["choices"][0]["message"]
        assert cached(on) > 0
        assert on["usage"]["timings"]["anchor_hits"][0]["kind"] == "instruction"
    # a ledger that is behind the worker (a confirm reply lost, a kill between the worker's
    # confirm and the ledger's commit): the worker reports what it holds, the proxy learns it
    conn = sqlite3.connect(tmp_path / "ledger.sqlite3")
    with conn:
        conn.execute("DELETE FROM anchors")
    conn.close()
    with proxy_process(worker.url, state_dir=str(tmp_path), port=port) as proxy:
        assert admin(proxy, "/admin/anchors")["data"] == []
        follow = [*fresh[:-1], {"role": "user", "content": "Yet another new question."}]
        on, ref = ask(proxy, follow, tools), ask(off, follow, tools)
        assert on["choices"][0]["message"] == ref["choices"][0]["message"]
        assert cached(on) > 0
        learned = {(r["key"], r["depth"]) for r in admin(proxy, "/admin/anchors")["data"]}
        hits = on["usage"]["timings"]["anchor_hits"]
        assert hits and hits[0]["kind"] == "instruction"
        assert {h["depth"] for h in hits} <= {d for _, d in learned}
        check_ledger_matches_worker(proxy)


def test_worker_restart_loses_anchors_and_rewarms_pinned_toolsets(default_model_dir, tmp_path):
    port = free_port()
    tools = convs(1)[0]["tools"][:2]
    sys_msg = [{"role": "system", "content": "You are a careful file-system assistant."}]
    with worker_process(model=str(default_model_dir), port=port) as w1, \
            proxy_process(w1.url, state_dir=str(tmp_path)) as proxy, \
            proxy_process(w1.url, "--no-anchors") as ref:
        msgs = sys_msg + [{"role": "user", "content": "List the files."}]
        ask(proxy, msgs, tools)  # the anonymous tenant exists from its first request on
        made = httpx.post(proxy.url + "/admin/tenants/anonymous/toolsets", headers=ADMIN,
                          timeout=300, json={"messages": sys_msg, "tools": tools, "pin": True})
        assert made.status_code == 200, made.text
        ts = made.json()
        assert cached(ask(proxy, msgs, tools)) >= ts["anchor"]["depth"]
        old_epoch = admin(proxy, "/admin/stats")["epoch"]
        w1.kill()
        with worker_process(model=str(default_model_dir), port=port):
            # the first request plans the dead epoch's chain, which the worker refuses, unless
            # a health check saw the new epoch first and the toolset was warmed again: then
            # exactly the toolset's prefix is restored, never more
            first = ask(proxy, msgs, tools)
            assert cached(first) in (0, ts["anchor"]["depth"]), first["usage"]
            assert first["choices"][0]["message"] == ask(ref, msgs, tools)["choices"][0]["message"]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                slots = admin(proxy, "/admin/slots")["data"]
                if any(s["key"] == ts["toolset"] and s["pinned"] for s in slots):
                    break
                time.sleep(0.5)
            else:
                raise AssertionError("the pinned toolset was not re-warmed")
            stats = admin(proxy, "/admin/stats")
            assert stats["epoch"] != old_epoch
            lost = admin(proxy, "/admin/anchors", status="lost", epoch="all")["data"]
            assert lost and {r["epoch"] for r in lost} == {old_epoch}
            again = ask(proxy, sys_msg + [{"role": "user", "content": "Show the disk usage."}], tools)
            assert cached(again) == ts["anchor"]["depth"]
            check_ledger_matches_worker(proxy)
