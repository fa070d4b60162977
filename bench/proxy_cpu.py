"""The proxy's own CPU per request, by conversation length.

The proxy (a real `anchorcache proxy` process, anchors on unless `--no-anchors`, its own ledger) stands in front
of an *instant worker*: the worker contract's HTTP layer (`ext/contract.py`) over a backend
that answers at once with fixed tokens, one per event, and reports every snapshot it was
asked for as written (keys derived as a worker derives them) and every restore link as
restored. It costs nothing, so what is measured is the proxy alone: the one place a
stand-in is right.

For each conversation length (an agent conversation of the base set, grown with the tool
turns of others to about 1k, 8k, 32k and 100k tokens), one cold turn, then `--turns`
streamed and `--turns` non-streamed agent turns in order (each adds the assistant's tool
call and its result), one at a time. Per request: the proxy process's CPU time (every
thread's run time, /proc/<pid>/task/*/schedstat, in nanoseconds). Then `--concurrent`
conversations of the 8k size at once: requests/s of the proxy alone and its CPU per
request. Prints a table, writes bench/results/<name>.json and .png.

`--processes 1,2` measures instead how requests/s scale with proxy processes
(`anchorcache proxy --processes N`, one proxy per N, each its own ledger): `--concurrent`
agents of the 8k size for `--seconds`, each request on a new connection (the kernel spreads
connections over the processes, SO_REUSEPORT, so a conversation's turns land anywhere), then
each agent on one keep-alive connection (its turns stay with one process); requests/s and
the CPU of every proxy process per request. The load generator (threads of
`--client-processes` processes) and the stub worker (`--stub-processes` processes on one
port) run on the same machine and compete with the proxies for its cores (the JSON records
how many there were): on a box of a few cores they, not the proxy, set the ceiling.

`--api anthropic|responses`: the turns by length go through Anthropic's `/v1/messages` (as
Claude Code sends them) or the Responses API's `/v1/responses` (whole input each turn, as
Codex sends it) instead of chat completions.

`--output-repeat N`: each reply is the fixed text N times (about 19 tokens each), for what
a token costs the proxy; `--token-interval-ms T`: the worker sends them one at a time, T ms
apart, as a decoding engine does (the proxy then has nothing to read by the batch).

    .venv/bin/python bench/proxy_cpu.py [--turns 10] [--concurrent 8] [--name proxy_cpu]
    .venv/bin/python bench/proxy_cpu.py --processes 1,2 [--concurrent 16] [--name proxy_processes]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from anchorcache import wire  # noqa: E402
from anchorcache.bench import cpu_ns, start_py_spy, stop_py_spy  # noqa: E402
from anchorcache.cli import free_port, wait_ready  # noqa: E402
from anchorcache.testing.data import conversations  # noqa: E402
from anchorcache.testing.servers import proxy_process  # noqa: E402

RESULTS = REPO / "bench" / "results"
SIZES = (1_000, 8_000, 32_000, 100_000)
MODEL_ID = "instant"
OUTPUT_TEXT = "I will call the tool to look that up for you now, then report what it says back."


# ---- the instant worker -------------------------------------------------------------------

def stub_worker(port: int, tokenizer_path: str, epoch: str = "", slot_base: int = 0,
                output_repeat: int = 1, token_interval_s: float = 0.0) -> None:
    """Serve the worker contract on `port` with a backend that answers at once (`epoch`:
    the worker's, shared by the stub's processes on one port; `slot_base`: where this
    process numbers its slots; `output_repeat`: the reply is OUTPUT_TEXT that many times;
    `token_interval_s`: a pause before each token, else all at once)."""
    from aiohttp import web

    from anchorcache.ext import contract
    from anchorcache.ext.contract import Backend, Tokens
    from anchorcache.proxy.splitter.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    eos = tokenizer.token_to_id("<|im_end|>")
    output = tuple(tokenizer.encode(OUTPUT_TEXT * output_repeat)) + (eos,)
    epoch = epoch or uuid.uuid4().hex

    class Instant(Backend):
        """Fixed tokens, one per event; every snapshot written, every restore a hit."""

        def __init__(self) -> None:
            self.slot = slot_base

        @property
        def epoch(self) -> str:
            return epoch

        async def prepare(self, req: wire.GenerateRequest, context: Any) -> Any:
            return req

        async def generate(self, handle: Any) -> AsyncGenerator[Any, None]:
            req: wire.GenerateRequest = handle
            for t in output:
                if token_interval_s:  # as a decoding engine: one token at a time
                    await asyncio.sleep(token_interval_s)
                yield Tokens((t,))
            plan, ids = req.anchor, req.input_ids
            restored: tuple[wire.AnchorHit, ...] = ()
            written: list[wire.AnchorWritten] = []
            if plan is not None:
                restored = tuple(wire.AnchorHit(r.key, r.depth, wire.AnchorKind.CONVERSATION)
                                 for r in plan.restore)
                keys = wire.anchor_keys(plan.namespace, MODEL_ID, ids,
                                        [s.depth for s in plan.snapshot])
                parent = plan.restore[-1].key if plan.restore else None
                for s in plan.snapshot:
                    if plan.restore and s.depth <= plan.restore[-1].depth:
                        continue  # restored already: a worker saves only past its restore
                    self.slot += 1
                    written.append(wire.AnchorWritten(self.slot, keys[s.depth], s.depth, parent,
                                                      1024, s.kind))
                    parent = keys[s.depth]
                if plan.snapshot_response:
                    self.slot += 1
                    full = ids + output
                    written.append(wire.AnchorWritten(
                        self.slot, wire.anchor_key(plan.namespace, MODEL_ID, full), len(full),
                        parent, 1024, wire.AnchorKind.RESPONSE))
            cached = restored[-1].depth if restored else 0
            yield wire.GenerateMeta(
                epoch=epoch, prompt_tokens=len(ids), completion_tokens=len(output),
                cached_tokens=cached, prefill_tokens=len(ids) - cached,
                finish_reason=wire.FinishStop(eos),
                anchors=wire.AnchorReport(restored=restored, written=tuple(written)),
                restore_ms=0.0, prefill_ms=0.0, decode_ms=0.0, rid=req.rid or "")

        async def finish(self, handle: Any, ok: bool) -> None:
            pass

        async def abort(self, rid: str) -> wire.AbortReply:
            return wire.AbortReply(rid, False, epoch)

        async def stop(self, rid: str, output_tokens: int | None) -> wire.StopReply:
            return wire.StopReply(rid, False, epoch)

        async def confirm(self, slots: list[int], rid: str | None) -> wire.ConfirmReply:
            return wire.ConfirmReply(tuple(slots), (), epoch)

        async def abort_slots(self, slots: list[int]) -> wire.SlotsAborted:
            return wire.SlotsAborted(tuple(slots), epoch)

        async def lookup(self, namespace: bytes, ids: tuple[int, ...],
                         depths: tuple[int, ...]) -> wire.LookupReply:
            return wire.LookupReply((), epoch)

        async def pin(self, key: bytes, cache_key: str | None, device: bool) -> wire.PinReply:
            return wire.PinReply(True, epoch, "none")

        async def unpin(self, key: bytes) -> wire.UnpinReply:
            return wire.UnpinReply(True, epoch)

        async def evict(self, key: bytes) -> wire.EvictReply:
            return wire.EvictReply(False, epoch)

        async def flush(self, device: bool) -> wire.FlushReply:
            return wire.FlushReply(0, epoch, device)

        async def slots(self) -> wire.SlotsReply:
            return wire.SlotsReply((), epoch)

        async def stats(self) -> wire.StatsReply:
            return wire.StatsReply(*(0 for _ in wire.STATS_COUNTERS), staged=0, epoch=epoch)

        async def model_info(self) -> wire.ModelInfo:
            return wire.ModelInfo(MODEL_ID, tokenizer_path, tokenizer_path, "Qwen3ForCausalLM",
                                  262_144, (eos,), False, tokenizer.backend.get_vocab_size(), "embedded", epoch)

        async def health(self) -> wire.WorkerHealth:
            return wire.WorkerHealth("ok", epoch)

    backend = Instant()

    def reply(r: contract.Reply) -> web.Response:
        return web.Response(body=r.body, status=r.status, content_type="application/json")

    def route(r: contract.Route) -> Any:
        async def handler(request: web.Request) -> web.Response:
            return reply(await contract.handle(backend, r, await request.read()))
        return handler

    async def generate(request: web.Request) -> web.StreamResponse:
        out = await contract.generate(backend, await request.read(), request)
        if isinstance(out, contract.Reply):
            return reply(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async for chunk in out:
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    app = web.Application(client_max_size=1 << 30)
    for r in contract.routes(False):
        app.router.add_route(r.method, r.path, route(r))
    app.router.add_post("/generate", generate)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None,
                reuse_port=True)


# ---- conversations ------------------------------------------------------------------------

def grown(target_tokens: int, turns: int, count_tokens: Any) -> tuple[list[dict], list[int]]:
    """An agent conversation of about `target_tokens` tokens, then `turns` more tool turns:
    (tools + messages, the message counts at which each request is made: the cold one at
    about `target_tokens`, then one per turn)."""
    convs = conversations("base")
    base = copy.deepcopy(convs[0])
    pool = [m for c in convs[1:] for m in c["messages"] if m["role"] in ("assistant", "tool")]
    # pairs of (assistant with tool calls, its tool results) from other conversations
    pairs: list[list[dict]] = []
    for i, m in enumerate(pool):
        if m["role"] == "assistant" and m.get("tool_calls") and i + 1 < len(pool) \
                and pool[i + 1]["role"] == "tool":
            n = len(m["tool_calls"])
            results = pool[i + 1:i + 1 + n]
            if len(results) == n and all(r["role"] == "tool" for r in results):
                calls = [dict(c, id=f"call_{len(pairs)}_{k}") for k, c in enumerate(m["tool_calls"])]
                pairs.append([dict(m, tool_calls=calls)]
                             + [dict(r, tool_call_id=calls[k]["id"]) for k, r in enumerate(results)])
    messages = [m for m in base["messages"] if m["role"] in ("system", "user")][:2]
    while len(base["tools"]) > 1 and count_tokens(base["tools"], messages) > target_tokens:
        base["tools"] = base["tools"][:-1]  # a short conversation has fewer tools

    def with_pairs(k: int) -> list[dict]:
        return messages + [m for j in range(k) for m in pairs[j % len(pairs)]]

    # the fewest pairs that reach the target (tokens grow with pairs): doubling, then bisecting
    hi = 1
    while count_tokens(base["tools"], with_pairs(hi)) < target_tokens:
        hi *= 2
    lo = hi // 2  # below the target, or 0
    while lo < hi:
        mid = (lo + hi) // 2
        if count_tokens(base["tools"], with_pairs(mid)) < target_tokens:
            lo = mid + 1
        else:
            hi = mid
    k = lo
    messages = with_pairs(k)
    stops = [len(messages)]
    for _ in range(turns):
        messages += pairs[k % len(pairs)]
        k += 1
        stops.append(len(messages))
    return [{"tools": base["tools"], "messages": messages}], stops


# ---- measuring ----------------------------------------------------------------------------

def _post(client: httpx.Client, url: str, body: dict[str, Any], stream: bool) -> None:
    if stream:
        with client.stream("POST", url, json=body) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                pass
    else:
        client.post(url, json=body).raise_for_status()


def request(client: httpx.Client, url: str, tools: list, messages: list, stream: bool) -> None:
    body = {"model": "default", "messages": messages, "tools": tools, "max_tokens": 64,
            "temperature": 0, "stream": stream}
    _post(client, url + "/v1/chat/completions", body, stream)


def as_anthropic(tools: list, messages: list, stream: bool) -> dict[str, Any]:
    """The same conversation as an Anthropic `/v1/messages` body (what Claude Code sends):
    the system prompt apart, tool calls as `tool_use` blocks, each run of tool results one
    user message of `tool_result` blocks."""
    out: list[dict[str, Any]] = []
    system = ""
    ids: dict[str, str] = {}  # call id → a tool_use id unique in the conversation (`grown`
    for i, m in enumerate(messages):  # reuses its pairs of calls and results)
        if m["role"] == "system":
            system = m["content"]
        elif m["role"] == "user":
            out.append({"role": "user", "content": m["content"]})
        elif m["role"] == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": m["content"]}] \
                if m.get("content") else []
            for call in m.get("tool_calls") or []:
                args = call["function"]["arguments"]
                ids[call["id"]] = f"{call['id']}_{i}"
                blocks.append({"type": "tool_use", "id": ids[call["id"]],
                               "name": call["function"]["name"],
                               "input": json.loads(args) if isinstance(args, str) else args})
            out.append({"role": "assistant", "content": blocks})
        else:
            result = {"type": "tool_result", "tool_use_id": ids[m["tool_call_id"]],
                      "content": m["content"]}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(result)
            else:
                out.append({"role": "user", "content": [result]})
    return {"model": "default", "system": system, "messages": out, "max_tokens": 64,
            "temperature": 0, "stream": stream,
            "tools": [{"name": t["function"]["name"],
                       "description": t["function"].get("description", ""),
                       "input_schema": t["function"]["parameters"]} for t in tools]}


def anthropic_request(client: httpx.Client, url: str, tools: list, messages: list,
                      stream: bool) -> None:
    _post(client, url + "/v1/messages", as_anthropic(tools, messages, stream), stream)


def as_responses(tools: list, messages: list, stream: bool) -> dict[str, Any]:
    """The same conversation as an OpenAI Responses `/v1/responses` body, whole each turn
    (what Codex sends, `store: false`): the system prompt as `instructions`, tool calls as
    `function_call` items and their results as `function_call_output` items."""
    items: list[dict[str, Any]] = []
    instructions = None
    ids: dict[str, str] = {}  # call id → one unique in the conversation (as `as_anthropic`)
    for i, m in enumerate(messages):
        if m["role"] == "system":
            instructions = m["content"]
        elif m["role"] == "user":
            items.append({"type": "message", "role": "user", "content": m["content"]})
        elif m["role"] == "assistant":
            if m.get("content"):
                items.append({"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": m["content"]}]})
            for call in m.get("tool_calls") or []:
                args = call["function"]["arguments"]
                ids[call["id"]] = f"{call['id']}_{i}"
                items.append({"type": "function_call", "call_id": ids[call["id"]],
                              "name": call["function"]["name"],
                              "arguments": args if isinstance(args, str) else json.dumps(args)})
        else:
            items.append({"type": "function_call_output", "call_id": ids[m["tool_call_id"]],
                          "output": m["content"]})
    return {"model": "default", "instructions": instructions, "input": items, "store": False,
            "max_output_tokens": 64, "temperature": 0, "stream": stream,
            "tools": [{"type": "function", "name": t["function"]["name"],
                       "description": t["function"].get("description", ""),
                       "parameters": t["function"]["parameters"]} for t in tools]}


def responses_request(client: httpx.Client, url: str, tools: list, messages: list,
                      stream: bool) -> None:
    _post(client, url + "/v1/responses", as_responses(tools, messages, stream), stream)


APIS = {"chat": request, "anthropic": anthropic_request, "responses": responses_request}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def by_length(url: str, pid: int, turns: int, count_tokens: Any,
              sizes: tuple[int, ...], after_cold: Any = None, send: Any = request) -> list[dict]:
    """Per size: the cold turn, then the warm ones; `after_cold()` is called once, after
    the first cold turn (the profiler starts there: the cold turns' tokenizing would
    otherwise fill the profile). `send`: the API's request (`APIS`)."""
    rows = []
    with httpx.Client(timeout=300) as client:
        for size in sizes:
            (conv,), stops = grown(size, 2 * turns, count_tokens)
            tools, messages = conv["tools"], conv["messages"]
            samples: dict[str, list[float]] = {"cold": [], "stream": [], "plain": []}
            for i, stop in enumerate(stops):
                mode = "cold" if i == 0 else "stream" if i <= turns else "plain"
                before = cpu_ns(pid)
                send(client, url, tools, messages[:stop], mode == "stream")
                time.sleep(0.05)  # the proxy's after-reply work (confirm, ledger) lands in this turn
                samples[mode].append((cpu_ns(pid) - before) / 1e6)
                if after_cold is not None and i == 0:
                    after_cold()
                    after_cold = None
            tokens = count_tokens(tools, messages[:stops[0]])
            for mode in ("stream", "plain"):
                xs = samples[mode]
                rows.append({"size": size, "tokens": tokens, "stream": mode == "stream",
                             "cold_ms": round(samples["cold"][0], 2), "n": len(xs),
                             "p50_ms": round(statistics.median(xs), 2),
                             "p99_ms": round(pct(xs, 0.99), 2),
                             "mean_ms": round(statistics.fmean(xs), 2)})
    return rows


def throughput(url: str, pid: int, concurrent: int, turns: int, count_tokens: Any,
               stagger_s: float = 0.0) -> dict:
    """`concurrent` agents of one tenant, each its own 8k conversation of `turns` turns
    (agent j starting `j * stagger_s` in: a tenant's agents do not all begin at one
    instant, and a burst of first turns past the tenant's waiting splits is refused)."""
    (conv,), stops = grown(8_000, turns, count_tokens)
    tools, messages = conv["tools"], conv["messages"]

    def agent(j: int) -> int:
        # each agent its own conversation: a different first user message
        msgs = [dict(m) for m in messages]
        own(msgs, j)
        time.sleep(j * stagger_s)
        with httpx.Client(timeout=300) as client:
            for stop in stops:
                request(client, url, tools, msgs[:stop], True)
        return len(stops)

    n, wall, cpu_ms = run_agents(agent, concurrent, lambda: cpu_ns(pid))
    return {"concurrent": concurrent, "requests": n, "wall_s": round(wall, 2),
            "requests_per_s": round(n / wall, 1),
            "cpu_ms_per_request": round(cpu_ms / n, 2),
            "cpu_bound_requests_per_s": round(1000 * n / cpu_ms, 1)}


def own(messages: list[dict], j: int | str) -> None:
    """Make `messages` agent `j`'s own conversation: a different first user message."""
    first_user = next(m for m in messages if m["role"] == "user")
    first_user["content"] = f"[agent {j}] " + str(first_user["content"])


def run_agents(agent: Any, concurrent: int, cpu: Any) -> tuple[int, float, float]:
    """Run `agent(j)` for j < `concurrent` at once: (requests, wall s, `cpu()` ms spent)."""
    before, start = cpu(), time.perf_counter()
    with cf.ThreadPoolExecutor(concurrent) as pool:
        n = sum(pool.map(agent, range(concurrent)))
    return n, time.perf_counter() - start, (cpu() - before) / 1e6


def tree_cpu_ns(pid: int) -> int:
    """`cpu_ns` of process `pid` and every process below it (a proxy's processes)."""
    import psutil

    pids = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    return sum(cpu_ns(p) for p in pids if Path(f"/proc/{p}").exists())


def _agents(url: str, tools: list, messages: list[dict], stops: list[int], deadline: float,
            per_agent: bool, names: list[str]) -> int:
    """Agents `names` (threads of this process) until `deadline` (time.time()): each its own
    conversation's turns, streamed, a new conversation each round. Requests made."""
    def agent(j: str) -> int:
        n, rounds = 0, 0
        kept = httpx.Client(timeout=300) if per_agent else None
        while time.time() < deadline:
            msgs = [dict(m) for m in messages]  # each round a new conversation
            own(msgs, f"{j}.{rounds}")
            rounds += 1
            for stop in stops:
                if time.time() >= deadline:
                    break
                with contextlib.nullcontext(kept) if kept else httpx.Client(timeout=300) as client:
                    request(client, url, tools, msgs[:stop], True)
                n += 1
        if kept is not None:
            kept.close()
        return n

    with cf.ThreadPoolExecutor(len(names)) as pool:
        return sum(pool.map(agent, names))


def scaling(url: str, pid: int, concurrent: int, seconds: float, count_tokens: Any,
            per_agent: bool, client_processes: int = 1) -> dict:
    """Requests/s of `concurrent` agents for `seconds` (threads of `client_processes`
    processes), and the proxy's CPU (all its processes) per request. Each request on a new
    connection, or (`per_agent`) each agent's on one keep-alive connection (its conversation
    stays with one process)."""
    (conv,), stops = grown(8_000, 40, count_tokens)
    tools, messages = conv["tools"], conv["messages"]
    request(httpx.Client(timeout=300), url, tools, messages[:stops[0]], True)  # warm up
    names = [str(j) for j in range(concurrent)]
    groups = [names[k::client_processes] for k in range(client_processes)]
    before, start = tree_cpu_ns(pid), time.perf_counter()
    deadline = time.time() + seconds
    with cf.ProcessPoolExecutor(client_processes) as pool:
        n = sum(pool.map(_agents, *zip(*[(url, tools, messages, stops, deadline, per_agent, g)
                                          for g in groups if g], strict=True)))
    wall, cpu_ms = time.perf_counter() - start, (tree_cpu_ns(pid) - before) / 1e6
    return {"concurrent": concurrent, "requests": n, "wall_s": round(wall, 2),
            "requests_per_s": round(n / wall, 1), "cpu_ms_per_request": round(cpu_ms / n, 2)}


def by_processes(stub_url: str, counts: list[int], concurrent: int, seconds: float,
                 count_tokens: Any, client_processes: int) -> list[dict]:
    rows = []
    for connections in ("per_request", "per_agent"):
        for n in counts:
            with proxy_process(stub_url, "--processes", str(n)) as proxy:
                rows.append({"processes": n, "connections": connections,
                             **scaling(proxy.url, proxy.proc.pid, concurrent, seconds,
                                       count_tokens, connections == "per_agent",
                                       client_processes)})
        base = rows[-len(counts)]["requests_per_s"]
        for r in rows[-len(counts):]:
            r["speedup"] = round(r["requests_per_s"] / base, 2) if base else None
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for stream in (True, False):
        rs = [r for r in rows if r["stream"] is stream]
        label = "streamed" if stream else "not streamed"
        ax.plot([r["tokens"] for r in rs], [r["p50_ms"] for r in rs], "o-", label=label + " p50")
        ax.plot([r["tokens"] for r in rs], [r["p99_ms"] for r in rs], "x--", label=label + " p99")
    ax.set_xscale("log")
    ax.set_xlabel("conversation tokens")
    ax.set_ylabel("proxy CPU ms per turn")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("proxy CPU per request, instant worker")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--stagger-ms", type=float, default=0.0,
                    help="the concurrent run's agents start this far apart")
    ap.add_argument("--name", default="proxy_cpu")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)),
                    help="conversation lengths in tokens, comma-separated")
    ap.add_argument("--no-throughput", action="store_true", help="skip the concurrent run")
    ap.add_argument("--no-anchors", action="store_true",
                    help="the proxy with --no-anchors: what its anchor work costs, by difference")
    ap.add_argument("--api", choices=sorted(APIS), default="chat",
                    help="the API the turns by length are sent through (the concurrent run "
                         "is OpenAI chat's)")
    ap.add_argument("--profile", help="py-spy record the proxy into this file (raw format)")
    ap.add_argument("--processes", help="proxy process counts to compare in requests/s, "
                                        "comma-separated (e.g. 1,2); only that is measured")
    ap.add_argument("--seconds", type=float, default=20.0,
                    help="how long each process count is loaded (--processes)")
    cpus = os.cpu_count() or 1
    ap.add_argument("--client-processes", type=int, default=max(1, cpus // 4),
                    help="processes the --processes load generator's agents run in (default: "
                         "a quarter of the cores)")
    ap.add_argument("--stub-processes", type=int, default=max(1, cpus // 4),
                    help="processes of the instant worker, on one port (default: a quarter "
                         "of the cores)")
    ap.add_argument("--output-repeat", type=int, default=1,
                    help="each reply is the fixed text this many times (about 19 tokens each)")
    ap.add_argument("--token-interval-ms", type=float, default=0.0,
                    help="the instant worker pauses this long before each token (0: sends "
                         "them all at once, which the proxy reads as one batch)")
    ap.add_argument("--stub-worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    ap.add_argument("--stub-epoch", default="", help=argparse.SUPPRESS)
    ap.add_argument("--stub-slot-base", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir

    tokenizer_path = args.tokenizer or str(build_tiny_model("qwen3", tiny_model_dir("qwen3")))
    if args.stub_worker:
        stub_worker(args.stub_worker, tokenizer_path, args.stub_epoch, args.stub_slot_base,
                    args.output_repeat, args.token_interval_ms / 1000)
        return

    from anchorcache.proxy.splitter.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)

    def count_tokens(tools: list, messages: list) -> int:
        return len(tokenizer.encode(tokenizer.render(messages, tools)))

    port, epoch = free_port(), uuid.uuid4().hex
    stubs = [subprocess.Popen([sys.executable, __file__, "--stub-worker", str(port),
                               "--tokenizer", tokenizer_path, "--stub-epoch", epoch,
                               "--stub-slot-base", str(k << 40),
                               "--output-repeat", str(args.output_repeat),
                               "--token-interval-ms", str(args.token_interval_ms)],
                              start_new_session=True)
             for k in range(args.stub_processes if args.processes else 1)]
    stub = stubs[0]

    def stop_stubs() -> None:
        for p in stubs:
            p.terminate()
        for p in stubs:
            p.wait(timeout=30)

    if args.processes:
        try:
            for p in stubs:
                wait_ready(f"http://127.0.0.1:{port}/health", p, timeout_s=120)
            counts = [int(x) for x in args.processes.split(",")]
            scale = by_processes(f"http://127.0.0.1:{port}", counts, args.concurrent,
                                 args.seconds, count_tokens, args.client_processes)
        finally:
            stop_stubs()
        print(f"{'connections':>12} {'processes':>9} {'requests/s':>10} {'speedup':>8} "
              f"{'CPU ms/req':>10} {'requests':>8}")
        for r in scale:
            print(f"{r['connections']:>12} {r['processes']:>9} {r['requests_per_s']:>10} "
                  f"{r['speedup']:>8} {r['cpu_ms_per_request']:>10} {r['requests']:>8}")
        RESULTS.mkdir(exist_ok=True)
        name = args.name if args.name != "proxy_cpu" else "proxy_processes"
        out = {"command": " ".join(["bench/proxy_cpu.py", *sys.argv[1:]]),
               "cpus": os.cpu_count(), "client": f"{args.concurrent} threads of httpx in "
               f"{args.client_processes} process(es) on the same machine, streamed; a new "
               "connection per request (per_request) or one keep-alive connection per agent "
               "(per_agent)", "stub_processes": args.stub_processes,
               "output_text": OUTPUT_TEXT * args.output_repeat, "by_processes": scale}
        (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")
        return
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", stub, timeout_s=120)
        with proxy_process(f"http://127.0.0.1:{port}",
                           *(["--no-anchors"] if args.no_anchors else [])) as proxy:
            pid = proxy.proc.pid
            spies = []

            def profile() -> None:
                spies.append(start_py_spy(pid, args.profile))

            rows = by_length(proxy.url, pid, args.turns, count_tokens,
                             tuple(int(s) for s in args.sizes.split(",")),
                             profile if args.profile else None, APIS[args.api])
            rate = None if args.no_throughput else throughput(
                proxy.url, pid, args.concurrent, args.turns, count_tokens,
                args.stagger_ms / 1e3)
            for spy in spies:
                stop_py_spy(spy)
    finally:
        stop_stubs()

    print(f"{'tokens':>8} {'mode':>8} {'cold ms':>8} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for r in rows:
        print(f"{r['tokens']:>8} {'stream' if r['stream'] else 'plain':>8} {r['cold_ms']:>8} "
              f"{r['p50_ms']:>8} {r['p99_ms']:>8} {r['mean_ms']:>8}")
    if rate is not None:
        print(f"{args.concurrent} concurrent 8k conversations: {rate['requests_per_s']} "
              f"requests/s, {rate['cpu_ms_per_request']} ms proxy CPU per request "
              f"(CPU-bound: {rate['cpu_bound_requests_per_s']} requests/s per core)")
    RESULTS.mkdir(exist_ok=True)
    out = {"command": " ".join(["bench/proxy_cpu.py", *sys.argv[1:]]), "cpus": os.cpu_count(),
           "api": args.api, "output_text": OUTPUT_TEXT * args.output_repeat, "by_length": rows, "throughput": rate}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(rows, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    main()
