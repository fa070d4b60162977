"""`anchorcache bench`: a small replay through a real proxy writes a valid report and a PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from anchorcache.cli import free_port
from anchorcache.testing.data import conversations
from anchorcache.testing.servers import Server


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "anchorcache.cli", "bench", *args],
                          capture_output=True, text=True, timeout=900)


def write_conversations(path: Path, n: int) -> Path:
    convs = sorted(conversations("base"), key=lambda c: len(str(c)))[:n]
    path.write_text(json.dumps(convs))
    return path


@pytest.mark.slow
def test_bench_replays_on_vs_off_and_writes_json_and_png(proxy: Server, tmp_path: Path):
    convs = write_conversations(tmp_path / "convs.json", 1)
    out = tmp_path / "report"
    run = bench(str(convs), "--url", proxy.url, "--max-turns", "2", "--max-tokens", "4",
                "--out", str(out))
    assert run.returncode == 0, run.stderr
    data = json.loads((tmp_path / "report.json").read_text())
    turns = data["turns"]
    assert [t["turn"] for t in turns] == [1, 2]
    assert all(t["identical"] for t in turns)
    for t in turns:
        # anchors off (per request, same proxy) prefilled everything; on: the rest came back
        assert t["prefilled_off"] == t["prompt_tokens"]
        assert t["prefilled_on"] + t["cached_on"] == t["prompt_tokens"]
        assert t["ttft_on_s"] > 0 and t["ttft_off_s"] > 0
    assert turns[0]["ideal"] == turns[0]["prompt_tokens"]  # nothing seen before in the replay
    assert 0 < turns[1]["ideal"] < turns[1]["prompt_tokens"]
    assert turns[1]["cached_on"] > 0 and turns[1]["anchor_hits"]
    assert data["summary"]["requests"] == 2 and data["summary"]["mismatches"] == 0
    assert data["summary"]["prefilled_on"] == sum(t["prefilled_on"] for t in turns)
    assert data["model"] and data["max_tokens"] == 4
    png = tmp_path / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert height > 100 and width > 100
    assert "multi_turn_base" in run.stdout  # the table


def test_bench_bad_input_and_unreachable_proxy_exit_with_one_line(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    run = bench(str(bad), "--url", "http://127.0.0.1:9")
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "non-empty JSON list" in run.stderr

    convs = write_conversations(tmp_path / "convs.json", 1)
    run = bench(str(convs), "--url", f"http://127.0.0.1:{free_port()}", "--max-turns", "1",
                "--out", str(tmp_path / "never"))
    assert run.returncode == 3
    assert run.stderr.strip().splitlines()[-1].startswith("error: http://127.0.0.1:")
    assert not (tmp_path / "never.json").exists()
