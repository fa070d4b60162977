"""Several workers behind one proxy: anchor-affinity routing against round-robin,
a worker SIGKILLed mid-run, a worker added and one drained live, `ops workers`, the
`worker` metrics label.

Real processes: embedded workers on the tiny random Qwen3 (the real tokenizer, so the
prompts are the real BFCL prompts) and proxies in front of them. Routing alone is under
test here, so the embedded worker carries it; the SGLang path of the same proxy code is
tests/e2e/test_sglang_proxy.py's.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from anchorcache.testing.data import conversations, turn_requests
from anchorcache.testing.servers import (
    ADMIN,
    ADMIN_TOKEN,
    Server,
    admin,
    ask,
    process_client,
    proxy_process,
    worker_process,
)
from anchorcache.testing.stacks import tiny_model

pytestmark = pytest.mark.slow

TURNS = 3


@pytest.fixture(scope="module")
def model() -> str:
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def workers(model) -> Iterator[list[Server]]:
    """Two workers shared by the routing comparisons (each proxy has its own ledger, so its
    own namespaces: no proxy restores another's anchors)."""
    with worker_process(model=model) as a, worker_process(model=model) as b:
        yield [a, b]


TOOLSETS = ("add_to_watchlist", "cat")  # the first tool of two BFCL toolsets (trading, files)


def traffic(n: int = 8) -> list[tuple[int, list[dict], list[dict]]]:
    """`n` BFCL conversations over two toolsets (alternating), their first turns interleaved:
    every conversation's turn 1, then every turn 2 in the reverse order, then every turn 3...
    (conversation, messages, tools). The order flips each round so that round-robin does
    not keep a conversation in place by chance."""
    by_toolset = [[c for c in sorted(conversations("base"), key=lambda c: len(str(c)))
                   if c["tools"][0]["function"]["name"] == name] for name in TOOLSETS]
    convs = [by_toolset[i % 2][i // 2] for i in range(n)]
    turns = [turn_requests(c, TURNS) for c in convs]
    assert all(len(t) == TURNS for t in turns)
    return [(i, turns[i][t], convs[i]["tools"][:3])
            for t in range(TURNS) for i in (range(n) if t % 2 == 0 else reversed(range(n)))]


def instruction_depth(proxy: Server) -> int:
    """The deepest instruction anchor the proxy's ledger ever recorded."""
    rows = admin(proxy, "/admin/anchors", params={"status": "all", "epoch": "all"})["data"]
    return max(r["depth"] for r in rows if r["kind"] == "instruction")


def prefilled(reply: dict) -> int:
    u = reply["usage"]
    return u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]


def replay(proxy: Server, requests) -> list[tuple[int, dict, str]]:
    return [(conv, *ask(proxy, messages, tools)) for conv, messages, tools in requests]


def test_affinity_routing_keeps_every_chain_on_its_worker(workers):
    requests = traffic()
    with proxy_process(workers[0].url) as single:
        alone = replay(single, requests)
    with proxy_process([w.url for w in workers]) as proxy:
        routed = replay(proxy, requests)
        listed = admin(proxy, "/admin/workers")["data"]
        instruction = instruction_depth(proxy)
    with proxy_process([w.url for w in workers], "--route", "round_robin") as rr:
        robin = replay(rr, requests)
    # two proxy processes, each request on the other one (every turn of a conversation
    # follows one the other process served): each routes by what the other committed
    with proxy_process([w.url for w in workers], "--processes", "2") as two:
        clients = [process_client(two, 0), process_client(two, 1)]
        shared = [(conv, *ask(two, messages, tools, clients[k % 2]))
                  for k, (conv, messages, tools) in enumerate(requests)]

    # outputs equal one worker's, token for token (greedy; the same chunking either way)
    assert [r["choices"][0]["message"] for _, r, _ in routed] == \
        [r["choices"][0]["message"] for _, r, _ in alone]
    # a conversation stays where its first turn went; a new conversation goes where its
    # toolset is (loads being equal): one toolset per worker here
    home: dict[int, str] = {}
    for conv, _, worker in routed:
        assert home.setdefault(conv, worker) == worker, f"conversation {conv} moved"
    assert home == {i: "w0" if i % 2 == 0 else "w1" for i in range(len(home))}
    # turns >= 2 restore exactly what they restore on one worker
    n = len(requests) // TURNS
    for (_, r, _), (_, a, _) in zip(routed[n:], alone[n:], strict=True):
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == \
            a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # what routing costs over one worker: at most one instruction anchor per worker per toolset
    ideal = sum(prefilled(a) for _, a, _ in alone)
    assert sum(prefilled(r) for _, r, _ in routed) <= 1.05 * ideal + len(TOOLSETS) * instruction
    # the same on two processes: the same outputs, workers and restores
    assert [(c, r["choices"][0]["message"], r["usage"]["prompt_tokens_details"], w)
            for c, r, w in shared] == \
        [(c, r["choices"][0]["message"], r["usage"]["prompt_tokens_details"], w)
         for c, r, w in routed]
    # round-robin sends turns away from their chains: measurably more prefill
    assert sum(prefilled(r) for _, r, _ in robin) > 1.3 * sum(prefilled(r) for _, r, _ in routed)
    assert {w["name"]: w["routed"] for w in listed} == \
        {w: sum(h == w for _, _, h in routed) for w in ("w0", "w1")}
    assert all(w["healthy"] and w["anchors"] > 0 and w["hit_rate"] > 0 for w in listed)


def test_a_busy_toolset_spreads_to_a_second_worker(workers):
    """With the toolset's worker busier than the other by more than the imbalance allowed,
    a new conversation goes to the other worker, which writes the toolset's instruction
    anchor too; the toolset's later conversations then go to either."""
    (_, first, tools), (_, second, _) = traffic(4)[0], traffic(4)[2]  # toolset 0, two convs
    with proxy_process([w.url for w in workers], "--route-max-imbalance", "0") as proxy:
        live: dict = {"started": threading.Event()}
        t = threading.Thread(target=stream_tokens, args=(proxy, first, tools, live, 300))
        t.start()
        assert live["started"].wait(60)
        _, worker = ask(proxy, second, tools)  # w0 holds the toolset but is busy
        t.join(120)
        assert (live["worker"], worker) == ("w0", "w1")
        rows = admin(proxy, "/admin/anchors")["data"]
        holders = {r["worker"] for r in rows if r["kind"] == "instruction"}
        assert holders == {w.url for w in workers}


def stream_tokens(proxy: Server, messages, tools, out: dict, max_tokens: int = 400) -> None:
    """A streaming request, recording which worker served it, its deltas and how it ended."""
    try:
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", timeout=300, json={
                "model": "default", "messages": messages, "tools": tools, "temperature": 0,
                "max_tokens": max_tokens, "stream": True,
                "stop": ["never-in-this-output-0xq"]}) as resp:
            out["status"] = resp.status_code
            out["worker"] = resp.headers.get("X-Anchorcache-Worker")
            out["events"] = []
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    out["events"].append(json.loads(line[6:]))
                    out.setdefault("started", threading.Event()).set()
    except httpx.HTTPError as e:
        out["transport_error"] = repr(e)
    finally:
        out.setdefault("started", threading.Event()).set()


def finish_reason(out: dict) -> str | None:
    return next((c["finish_reason"] for e in out["events"] for c in e.get("choices", ())
                 if c.get("finish_reason")), None)


def test_a_worker_killed_mid_run(model, workers):
    requests = traffic(6)
    n = len(requests) // TURNS
    with worker_process(model=model) as doomed, \
            proxy_process([workers[0].url, doomed.url], "--health-interval-s", "0.5") as proxy:
        first = replay(proxy, requests[:n])  # turn 1: conversations spread over both
        on_doomed = {conv for conv, _, w in first if w == "w1"}
        assert on_doomed and len(on_doomed) < n
        # a long generation streaming on the doomed worker when it dies
        conv = next(iter(on_doomed))
        msgs, tools = next((m, t) for c, m, t in requests[n:] if c == conv)
        live: dict = {"started": threading.Event()}
        t = threading.Thread(target=stream_tokens, args=(proxy, msgs, tools, live))
        t.start()
        assert live["started"].wait(60)
        doomed.kill()
        t.join(120)
        # it had streamed: it ends with a clean error event, not a hang or a cut connection
        assert live["status"] == 200 and live["worker"] == "w1"
        assert "transport_error" not in live, live
        assert live["events"][-1].get("error", {}).get("type") == "server_error", live["events"][-1]
        # every later request succeeds; only the doomed worker's conversations re-prefill
        later = replay(proxy, requests[n:])
        assert all(w == "w0" for _, _, w in later)
        turn1 = {c: r["usage"]["prompt_tokens_details"]["cached_tokens"] for c, r, _ in first}
        toolset_b = max(turn1[c] for c in on_doomed)  # their toolset's instruction anchor
        for conv_i, reply, _ in later[:n]:
            restored = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            if conv_i in on_doomed:  # at most their toolset, which w0 writes once now
                assert restored <= toolset_b
            else:  # its turn-1 chain, past its toolset
                assert restored > turn1[conv_i]
        # the ledger shows its anchors lost; the workers list shows it out
        lost = admin(proxy, "/admin/anchors", params={"status": "lost", "epoch": "all"})["data"]
        assert lost and {r["worker"] for r in lost} == {doomed.url}
        listed = {w["name"]: w for w in admin(proxy, "/admin/workers")["data"]}
        assert not listed["w1"]["healthy"] and listed["w0"]["healthy"]
        assert admin(proxy, "/admin/stats")["ledger"]["reservations"].get("open", 0) == 0


def test_a_request_not_yet_streamed_is_retried_elsewhere(model, workers):
    requests = traffic(2)
    with worker_process(model=model) as doomed, \
            proxy_process([doomed.url, workers[1].url], "--health-interval-s", "60") as proxy:
        doomed.kill()  # the proxy has not noticed: the next request routed there fails to connect
        replies = replay(proxy, requests[:2])
        assert [w for _, _, w in replies] == ["w1", "w1"]
        listed = {w["name"]: w for w in admin(proxy, "/admin/workers")["data"]}
        assert not listed["w0"]["healthy"]


def test_workers_added_and_drained_live(model, workers):
    requests = traffic(4)
    n = len(requests) // TURNS
    with proxy_process(workers[0].url) as proxy:
        ask(proxy, *requests[0][1:])
        added = admin(proxy, "/admin/workers", "POST", json={"url": workers[1].url})
        assert added["name"] == "w1" and added["healthy"]
        # new conversations go to the idle new worker (fewer routed, same load)
        assert ask(proxy, *requests[1][1:])[1] == "w1"
        # drain w1 while a long generation runs on it: the request completes, then w1 is gone
        conv = requests[1][0]
        msgs, tools = next((m, t) for c, m, t in requests[n:] if c == conv)
        live: dict = {"started": threading.Event()}
        t = threading.Thread(target=stream_tokens, args=(proxy, msgs, tools, live, 200))
        t.start()
        assert live["started"].wait(60)
        removed = admin(proxy, "/admin/workers/w1", "DELETE")
        t.join(120)
        assert removed["drained"] and removed["in_flight_at_drain"] == 1
        assert live["worker"] == "w1" and finish_reason(live) == "length"
        assert not any("error" in e for e in live["events"])
        assert [w["name"] for w in admin(proxy, "/admin/workers")["data"]] == ["w0"]
        assert ask(proxy, *requests[2][1:])[1] == "w0"
        # a worker serving another model is refused; an unknown one is a 404
        bad = httpx.post(proxy.url + "/admin/workers", headers=ADMIN, json={"url": "ftp://x"})
        assert bad.status_code == 400
        gone = httpx.delete(proxy.url + "/admin/workers/w9", headers=ADMIN)
        assert gone.status_code == 404

        # the operator's views: `ops workers` and the `worker` label on /metrics
        from anchorcache.cli import app

        out = CliRunner().invoke(app, ["ops", "workers", "--url", proxy.url, "--token",
                                       ADMIN_TOKEN, "--json"])
        assert out.exit_code == 0, out.output
        listed = json.loads(out.output)["data"]
        assert listed[0]["name"] == "w0" and listed[0]["routed"] == 2 and listed[0]["anchors"] > 0
        metrics = httpx.get(proxy.url + "/metrics").text
        assert 'anchorcache_worker_routed_total{worker="w0"} 2.0' in metrics
        assert 'anchorcache_worker_up{worker="w0"} 1.0' in metrics
