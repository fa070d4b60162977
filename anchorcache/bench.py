"""Replay agent conversations through running proxies, anchors on vs off; report and plot.

The shared data's format: a JSON list of conversations `{"id", "messages", "tools"}`; turn
`t`'s request is the messages before the conversation's `t`-th assistant message. Every
turn is sent to the anchors-on proxy and to the baseline (a second, anchors-off proxy, or
the same proxy with anchors turned off for the request by the `X-Anchorcache-Anchors: off`
header), streamed, greedy. Per turn the report has the prompt tokens, tokens prefilled on
each side, the ideal (tokens not seen before in this replay: the prompt minus its longest
common prefix with any earlier prompt), TTFT on each side (time to the first streamed
event, which the proxy sends with the first generated token) and whether both sides
produced the same message.

Used by `anchorcache bench` (against running proxies) and `bench/replay_bench.py` (which
starts its own worker and proxies).
"""

from __future__ import annotations

import contextlib
import json
import lzma
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

ANCHORS_HEADER = "X-Anchorcache-Anchors"


def cpu_ns(pid: int) -> int:
    """Run time of every thread of process `pid`, nanoseconds (/proc/<pid>/task/*/schedstat:
    exact, unlike the clock ticks of /proc/<pid>/stat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended
            total += int((task / "schedstat").read_text().split()[0])
    return total


def start_py_spy(pid: int, path: str) -> subprocess.Popen:
    """py-spy sampling process `pid` into `path` (raw format, every thread, the GIL holder's
    stacks only: a thread preempted in a syscall is not counted as work), once attached."""
    spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p",
                            str(pid), "-o", path, "--format", "raw", "-r", "200", "--threads",
                            "--gil"])
    time.sleep(1)
    return spy


def stop_py_spy(spy: subprocess.Popen) -> None:
    spy.send_signal(signal.SIGINT)  # (it writes its file then)
    spy.wait(timeout=60)

Conversation = dict[str, Any]
Messages = list[dict[str, Any]]


class BenchError(Exception):
    """A replay that cannot go on: bad input file, proxy unreachable or answering an error."""


def load_conversations(path: str | Path) -> list[Conversation]:
    """Read and check a conversations file (JSON, or JSON compressed with xz: `.xz`);
    raises BenchError with what is wrong."""
    path = Path(path)
    try:
        raw = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError, lzma.LZMAError) as e:
        raise BenchError(f"cannot read conversations from {path}: {e}") from None
    if not isinstance(data, list) or not data:
        raise BenchError(f"{path}: expected a non-empty JSON list of conversations")
    for i, conv in enumerate(data):
        if not (isinstance(conv, dict) and isinstance(conv.get("messages"), list)
                and isinstance(conv.get("tools", []), list)):
            raise BenchError(f"{path}: conversation {i} needs a 'messages' list "
                             "(and optionally a 'tools' list)")
        conv.setdefault("id", f"conversation_{i}")
        conv.setdefault("tools", [])
    return data


def turn_requests(conversation: Conversation, max_turns: int | None = None) -> list[Messages]:
    """Each turn's request: the messages up to (not including) each assistant message."""
    msgs = conversation["messages"]
    out = [msgs[:i] for i, m in enumerate(msgs) if m["role"] == "assistant" and i > 0]
    return out[:max_turns] if max_turns else out


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class Reply:
    """One streamed completion, as the bench sees it."""

    message: dict[str, Any]  # content, tool calls (name + arguments) and finish reason
    usage: dict[str, Any]
    ttft_s: float
    total_s: float


@dataclass(frozen=True)
class BenchTarget:
    """Where one side of the comparison is sent."""

    url: str
    anchors_off: bool = False  # ask the proxy to bypass anchors for these requests
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        h = {ANCHORS_HEADER: "off"} if self.anchors_off else {}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def ask(client: httpx.Client, target: BenchTarget, messages: Messages, tools: list[dict[str, Any]],
        max_tokens: int) -> Reply:
    """Send one greedy streamed chat request; raises BenchError on any failure."""
    body: dict[str, Any] = {"model": "default", "messages": messages, "temperature": 0,
                            "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if tools:
        body["tools"] = tools
    return _stream(client, target, "/v1/chat/completions", body)


def ask_tokens(client: httpx.Client, target: BenchTarget, input_ids: list[int],
               max_tokens: int) -> Reply:
    """The same, as a `/v1/completions` request whose prompt is token ids: what an engine's
    own OpenAI server serves with no rendering in front of it."""
    body = {"model": "default", "prompt": input_ids, "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    return _stream(client, target, "/v1/completions", body)


def _stream(client: httpx.Client, target: BenchTarget, path: str, body: dict[str, Any]) -> Reply:
    content: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    usage: dict[str, Any] | None = None
    finish = None
    ttft = None
    t0 = time.perf_counter()
    try:
        with client.stream("POST", target.url.rstrip("/") + path, json=body,
                           headers=target.headers()) as resp:
            if resp.status_code != 200:
                resp.read()
                raise BenchError(f"{target.url}: HTTP {resp.status_code}: {resp.text[:300]}")
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    raise BenchError(f"{target.url}: error mid-stream: {event['error']}")
                usage = event.get("usage") or usage
                for choice in event.get("choices", ()):
                    delta = choice.get("delta") or {}
                    if ttft is None and (delta.get("content") or delta.get("tool_calls")
                                         or choice.get("text") or choice.get("finish_reason")):
                        ttft = time.perf_counter() - t0  # the first output, not a role chunk
                    content.append(delta.get("content") or choice.get("text") or "")
                    for tc in delta.get("tool_calls") or ():
                        call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                        fn = tc.get("function") or {}
                        call["name"] += fn.get("name") or ""
                        call["arguments"] += fn.get("arguments") or ""
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as e:
        raise BenchError(f"{target.url}: {type(e).__name__}: {e}") from None
    total = time.perf_counter() - t0
    if usage is None or ttft is None:
        raise BenchError(f"{target.url}: the stream ended without usage")
    message = {"content": "".join(content), "tool_calls": [calls[i] for i in sorted(calls)],
               "finish_reason": finish}
    return Reply(message, usage, ttft, total)


def model_id(target: BenchTarget, timeout_s: float = 30.0) -> str:
    """The model the proxy serves (its `/v1/models`)."""
    try:
        resp = httpx.get(target.url.rstrip("/") + "/v1/models", headers=target.headers(),
                         timeout=timeout_s)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise BenchError(f"{target.url}: cannot read /v1/models: {e}") from None


@dataclass(frozen=True)
class TurnResult:
    conversation: str
    turn: int
    prompt_tokens: int
    ideal: int  # tokens not seen earlier in this replay
    prefilled_on: int
    prefilled_off: int
    cached_on: int
    ttft_on_s: float
    ttft_off_s: float
    restore_ms_on: float
    prefill_ms_on: float
    prefill_ms_off: float
    anchor_hits: tuple[str, ...]  # kinds of the anchors restored, root → leaf
    identical: bool  # same message (content, tool calls, finish reason) on and off

    @classmethod
    def from_replies(cls, conversation: str, turn: int, ideal: int, r_on: Reply,
                     r_off: Reply) -> TurnResult:
        u, u_off = r_on.usage, r_off.usage
        t, t_off = u.get("timings", {}), u_off.get("timings", {})
        return cls(
            conversation=conversation, turn=turn, prompt_tokens=u["prompt_tokens"], ideal=ideal,
            prefilled_on=t.get("prefill_tokens", u["prompt_tokens"]),
            prefilled_off=t_off.get("prefill_tokens", u_off["prompt_tokens"]),
            cached_on=u.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            ttft_on_s=round(r_on.ttft_s, 4), ttft_off_s=round(r_off.ttft_s, 4),
            restore_ms_on=t.get("restore_ms", 0.0), prefill_ms_on=t.get("prefill_ms", 0.0),
            prefill_ms_off=t_off.get("prefill_ms", 0.0),
            anchor_hits=tuple(h["kind"] for h in t.get("anchor_hits", ())),
            identical=r_on.message == r_off.message)


TokenizeFn = Callable[[Messages, list[dict[str, Any]]], Sequence[int]]


def replay(convs: Sequence[Conversation], on: BenchTarget, off: BenchTarget, *, tokenize: TokenizeFn,
           max_turns: int | None, max_tokens: int, timeout_s: float = 900.0,
           on_turn: Callable[[TurnResult], None] | None = None) -> list[TurnResult]:
    """Send every turn of every conversation to `off`, then to `on`; one result per turn."""
    results: list[TurnResult] = []
    seen: list[Sequence[int]] = []
    with httpx.Client(timeout=timeout_s) as client:
        for conv in convs:
            for turn, messages in enumerate(turn_requests(conv, max_turns), 1):
                ids = tokenize(messages, conv["tools"])
                ideal = len(ids) - max((lcp(ids, s) for s in seen), default=0)
                seen.append(ids)
                r_off = ask(client, off, messages, conv["tools"], max_tokens)
                r_on = ask(client, on, messages, conv["tools"], max_tokens)
                u = r_on.usage
                if u["prompt_tokens"] != len(ids):
                    raise BenchError(
                        f"{conv['id']} turn {turn}: the proxy counted {u['prompt_tokens']} prompt "
                        f"tokens, the local tokenizer {len(ids)}: pass the proxy's model "
                        "(--model) so that the ideal is measured in its tokens")
                result = TurnResult.from_replies(str(conv["id"]), turn, ideal, r_on, r_off)
                results.append(result)
                if on_turn is not None:
                    on_turn(result)
    return results


def summarize(results: Sequence[TurnResult]) -> dict[str, Any]:
    """Totals and ratios over the replay (turn 1 of a conversation is mostly cold)."""
    later = [r for r in results if r.turn >= 2]

    def ratio(num: float, den: float) -> float | None:
        return round(num / den, 4) if den else None

    speedups = [r.ttft_off_s / r.ttft_on_s for r in later if r.ttft_on_s > 0]
    return {
        "requests": len(results),
        "conversations": len({r.conversation for r in results}),
        "mismatches": sum(not r.identical for r in results),
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "prefilled_on": sum(r.prefilled_on for r in results),
        "prefilled_off": sum(r.prefilled_off for r in results),
        "cached_on": sum(r.cached_on for r in results),
        "ideal": sum(r.ideal for r in results),
        "prefill_over_ideal": ratio(sum(r.prefilled_on for r in results),
                                    sum(r.ideal for r in results)),
        "prefill_over_ideal_turn2plus": ratio(sum(r.prefilled_on for r in later),
                                              sum(r.ideal for r in later)),
        "ttft_on_median_s": round(statistics.median(r.ttft_on_s for r in results), 4)
        if results else None,
        "ttft_off_median_s": round(statistics.median(r.ttft_off_s for r in results), 4)
        if results else None,
        "ttft_speedup_turn2plus_median": round(statistics.median(speedups), 2)
        if speedups else None,
    }


def report(results: Sequence[TurnResult], *, model: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, **meta, "summary": summarize(results),
            "turns": [asdict(r) for r in results]}


def write_json(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def plot(results: Sequence[TurnResult], path: Path, title: str) -> None:
    """TTFT per turn (on vs off, log scale) above prefilled tokens per turn (on, off, ideal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(results)))
    labels = [f"{r.conversation.rsplit('_', 1)[-1]}/t{r.turn}" for r in results]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6.0, 0.3 * len(x) + 3), 7), sharex=True)
    ax1.plot(x, [r.ttft_off_s for r in results], "o-", label="anchors off")
    ax1.plot(x, [r.ttft_on_s for r in results], "o-", label="anchors on")
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT (s, log)")
    ax1.set_title(title)
    ax1.legend()
    ax2.plot(x, [r.prefilled_off for r in results], "o-", label="prefilled, anchors off")
    ax2.plot(x, [r.prefilled_on for r in results], "o-", label="prefilled, anchors on")
    ax2.plot(x, [r.ideal for r in results], "k--", label="ideal (new tokens)")
    ax2.set_yscale("symlog", linthresh=10)
    ax2.set_ylabel("prompt tokens prefilled")
    ax2.set_xticks(x, labels, rotation=90, fontsize=7)
    ax2.set_xlabel("conversation / turn")
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


TABLE_COLUMNS = ("conversation", "turn", "prompt", "prefill on", "ideal", "prefill off",
                 "ttft on s", "ttft off s", "same")


def table_rows(results: Sequence[TurnResult]) -> list[tuple[str, ...]]:
    return [(r.conversation, str(r.turn), str(r.prompt_tokens), str(r.prefilled_on),
             str(r.ideal), str(r.prefilled_off), f"{r.ttft_on_s:.3f}", f"{r.ttft_off_s:.3f}",
             "yes" if r.identical else "NO") for r in results]
