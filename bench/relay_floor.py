"""What a turn and a token cost the proxy, against the floor: a bare aiohttp relay.

The relay (this file, `--relay PORT WORKER_URL`) reads a chat request's body, posts one
fixed `/generate` body to the instant worker (bench/proxy_cpu.py's stub) and writes one
server-sent event per token event the worker sent (one write per read), and nothing else:
no tenant, template, split, routing, anchors, detokenizing, output parsing, ledger or
metrics. Its CPU per request is what relaying a token stream with aiohttp costs on this
machine; the proxy's, in the same run and against the same worker, less the relay's, is
the proxy's own work. A stand-in on both sides, on purpose: it measures the relay and
nothing else.

Per reply length (`--output-repeats`: the stub's fixed text that many times, about 19
tokens each, sent one at a time `--token-interval-ms` apart as a decoding engine sends
them): an 8k conversation's `--turns` streamed and `--turns` non-streamed turns one at a
time (p50 of the process's CPU per request), then `--concurrent` agents at once (CPU per
request); relay and proxy in turn, `--pairs` times. Prints a table, writes
bench/results/<name>.json.

    .venv/bin/python bench/relay_floor.py [--output-repeats 1,20] [--pairs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import proxy_cpu  # noqa: E402  (same folder: bench/ is sys.path[0])

from anchorcache.cli import free_port, wait_ready  # noqa: E402
from anchorcache.testing.servers import proxy_process  # noqa: E402

RESULTS = REPO / "bench" / "results"
SIZE = 8_000


def relay(port: int, worker: str) -> None:
    """Serve the relay on `port` in front of the instant worker at `worker`."""
    import aiohttp
    import orjson
    from aiohttp import web

    generate = orjson.dumps({"input_ids": list(range(1000, 2000)), "stream": True,
                             "sampling_params": {"max_new_tokens": 64, "temperature": 0}})

    async def chat(request: web.Request) -> web.StreamResponse:
        stream = orjson.loads(await request.read()).get("stream", False)
        resp: web.StreamResponse | None = None
        tokens = 0
        async with request.app["session"].post(worker + "/generate", data=generate) as r:
            if stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
            pending = b""
            async for data in r.content.iter_any():
                *lines, pending = (pending + data).split(b"\n")
                events = []
                for line in lines:
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        n = len(orjson.loads(line[6:]).get("output_ids", ()))
                        tokens += n
                        events.append(b"data: " + orjson.dumps(
                            {"object": "chat.completion.chunk",
                             "choices": [{"index": 0, "delta": {"content": "x" * n}}]})
                            + b"\n\n")
                if resp is not None and events:
                    await resp.write(b"".join(events))
        if resp is None:
            return web.json_response({"choices": [{"message": {"content": "x" * tokens}}]})
        await resp.write_eof(b"data: [DONE]\n\n")
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def session(app: web.Application):
        async with aiohttp.ClientSession() as s:
            app["session"] = s
            yield

    app = web.Application(client_max_size=1 << 30)
    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


@contextmanager
def relay_process(worker: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--relay", str(port), worker])
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout_s=120)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextmanager
def stub(repeat: int, interval_s: float, tokenizer: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "proxy_cpu.py"),
                             "--stub-worker", str(port), "--tokenizer", tokenizer,
                             "--stub-epoch", uuid.uuid4().hex, "--output-repeat", str(repeat),
                             "--token-interval-ms", str(interval_s * 1e3)],
                            start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout_s=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def measure(url: str, pid: int, turns: int, concurrent: int, count_tokens) -> dict:
    rows = proxy_cpu.by_length(url, pid, turns, count_tokens, (SIZE,))
    p50 = {("stream" if r["stream"] else "plain"): r["p50_ms"] for r in rows}
    rate = proxy_cpu.throughput(url, pid, concurrent, turns, count_tokens)
    return {"stream_p50_ms": p50["stream"], "plain_p50_ms": p50["plain"],
            "concurrent_ms_per_request": rate["cpu_ms_per_request"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-repeats", default="1,20")
    ap.add_argument("--token-interval-ms", type=float, default=1.0)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--name", default="relay_floor")
    ap.add_argument("--relay", nargs=2, metavar=("PORT", "WORKER_URL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.relay:
        relay(int(args.relay[0]), args.relay[1])
        return

    from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir
    from anchorcache.proxy.splitter.tokenizers import load_tokenizer

    tokenizer_path = str(build_tiny_model("qwen3", tiny_model_dir("qwen3")))
    tokenizer = load_tokenizer(tokenizer_path)

    def count_tokens(tools: list, messages: list) -> int:
        return len(tokenizer.encode(tokenizer.render(messages, tools)))

    rows = []
    for repeat in (int(r) for r in args.output_repeats.split(",")):
        runs: dict[str, list[dict]] = {"relay": [], "proxy": []}
        with stub(repeat, args.token_interval_ms / 1e3, tokenizer_path) as worker:
            for _ in range(args.pairs):
                with relay_process(worker) as (url, pid):
                    runs["relay"].append(measure(url, pid, args.turns, args.concurrent,
                                                 count_tokens))
                with proxy_process(worker) as proxy:
                    runs["proxy"].append(measure(proxy.url, proxy.proc.pid, args.turns,
                                                 args.concurrent, count_tokens))
        for what, ms in runs.items():
            row = {"server": what, "output_repeat": repeat,  # (the stub's reply, its eos)
                   "reply_tokens": len(tokenizer.encode(proxy_cpu.OUTPUT_TEXT * repeat)) + 1}
            for key in ms[0]:
                row[key] = round(statistics.median(m[key] for m in ms), 2)
                row[key.replace("_ms", "_runs_ms")] = [m[key] for m in ms]
            rows.append(row)

    print(f"{'server':>6} {'tokens':>6} {'stream p50':>10} {'plain p50':>9} "
          f"{args.concurrent:>2} at once (CPU ms a request, median of {args.pairs} runs)")
    for r in rows:
        print(f"{r['server']:>6} {r['reply_tokens']:>6} {r['stream_p50_ms']:>10} "
              f"{r['plain_p50_ms']:>9} {r['concurrent_ms_per_request']:>12}")
    RESULTS.mkdir(exist_ok=True)
    out = {"command": " ".join(["bench/relay_floor.py", *sys.argv[1:]]), "cpus": os.cpu_count(),
           "conversation_tokens": SIZE, "token_interval_ms": args.token_interval_ms,
           "rows": rows}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
