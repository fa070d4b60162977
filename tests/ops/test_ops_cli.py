"""`anchorcache ops` against a real proxy + worker: tables and --json reflect real state."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from anchorcache.cli import app, free_port
from anchorcache.testing.servers import ADMIN_TOKEN, Server, proxy_process

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]
SYSTEM = [{"role": "system", "content": "You are the ops-test dictionary assistant."}]


@pytest.fixture(scope="module")
def proxy(worker) -> Iterator[Server]:
    with proxy_process(worker.url) as server:
        yield server


def ops(proxy: Server, *args: str, token: str | None = ADMIN_TOKEN):
    env = {"ANCHORCACHE_URL": proxy.url, "COLUMNS": "200"}  # a wide terminal
    if token is not None:
        env["ANCHORCACHE_ADMIN_TOKEN"] = token
    return CliRunner().invoke(app, ["ops", *args], env=env)


def ask(proxy: Server, question: str) -> dict:
    resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=300, json={
        "model": "default", "messages": SYSTEM + [{"role": "user", "content": question}],
        "tools": TOOLS, "temperature": 0, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_slots_anchors_toolsets_evict_pin_stats(proxy):
    ask(proxy, "Define apple.")
    second = ask(proxy, "Define pear.")
    depth = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert depth > 0  # the second conversation restored the toolset's instruction anchor

    out = ops(proxy, "slots", "--json")
    assert out.exit_code == 0, out.output
    slots = json.loads(out.output)["data"]
    [inst] = [s for s in slots if s["kind"] == "instruction" and s["depth"] == depth]
    assert inst["hits"] >= 1 and inst["tenant"] == "anonymous"
    table = ops(proxy, "slots")
    assert table.exit_code == 0 and "instruction" in table.output and "anonymous" in table.output

    toolsets = json.loads(ops(proxy, "toolsets", "--json").output)["data"]
    assert [t["toolset"] for t in toolsets] == [inst["key"]]
    anchors = json.loads(ops(proxy, "anchors", "--json", "--tenant", "anonymous").output)["data"]
    assert inst["key"] in {a["key"] for a in anchors}

    pinned = ops(proxy, "pin", inst["key"], "--json")
    assert pinned.exit_code == 0 and json.loads(pinned.output)["pinned"] is True
    assert [s["pinned"] for s in json.loads(ops(proxy, "slots", "--json").output)["data"]
            if s["key"] == inst["key"]] == [True]
    assert ops(proxy, "unpin", inst["key"]).exit_code == 0

    assert ops(proxy, "evict", inst["key"]).exit_code == 0
    after = ask(proxy, "Define plum.")
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] < depth  # missed it

    stats = json.loads(ops(proxy, "stats", "--json").output)
    assert stats["requests"]["count"] >= 3 and stats["requests"]["cached_tokens"] >= depth
    assert "tokens saved" in ops(proxy, "stats").output
    assert ops(proxy, "watch", "--count", "1", "--interval", "0.2").exit_code == 0
    assert ops(proxy, "evict", "00" * 16).exit_code == 5


def test_tenants_and_warm(proxy, tmp_path):
    made = ops(proxy, "tenant-add", "ops-t", "--json")
    assert made.exit_code == 0 and json.loads(made.output)["api_key"].startswith("ac-")
    spec = tmp_path / "toolsets.json"
    spec.write_text(json.dumps([{"messages": SYSTEM, "tools": TOOLS},
                                {"messages": [{"role": "system", "content": "Other."}], "tools": []}]))
    warmed = ops(proxy, "warm", "ops-t", str(spec), "--json")
    assert warmed.exit_code == 0, warmed.output
    assert len(json.loads(warmed.output[warmed.output.index("{"):])["data"]) == 2
    listing = json.loads(ops(proxy, "tenants", "--json").output)["data"]
    [mine] = [t for t in listing if t["name"] == "ops-t"]
    assert mine["toolsets"] == 2
    assert ops(proxy, "warm", "nobody", str(spec)).exit_code == 5


def test_unreachable_and_bad_token_are_one_line_errors(proxy):
    wrong = ops(proxy, "stats", token="wrong-token-wrong-token")
    assert wrong.exit_code == 4 and len(wrong.output.strip().splitlines()) == 1
    missing = ops(proxy, "stats", token=None)
    assert missing.exit_code == 4
    gone = CliRunner().invoke(app, ["ops", "stats", "--url", f"http://127.0.0.1:{free_port()}",
                                    "--token", ADMIN_TOKEN])
    assert gone.exit_code == 3 and "cannot reach" in gone.output
    assert len(gone.output.strip().splitlines()) == 1
