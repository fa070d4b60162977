"""Agent CLIs end to end: the Codex CLI (`@openai/codex`, pinned in the Makefile and installed
beside the venv by `make agent-clis`) runs `codex exec` against a proxy of its own, in front
of the session's real default worker, over the Responses API; the config is docs/agents.md's.

SmolLM2 is sampled at temperature 1 (Codex sends none) and Codex fails a turn that ends
incomplete, so every turn asks for a JSON string of at most 40 characters
(`--output-schema`): the grammar bounds the reply. For the same reason Codex's tools are
off (a tool call's arguments are not bounded); its own instructions would fit the 8,192-token
context too (4,051 tokens with the tools off), a short instructions file keeps the prefill
small. Nothing is downloaded here, and the config turns off Codex's update check and
analytics: its only connection is to the proxy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from anchorcache.testing.servers import Server, proxy_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
AGENT_CLIS = ROOT / ".venv" / "agent-clis"
CODEX = AGENT_CLIS / "node_modules" / ".bin" / "codex"
INSTRUCTIONS = "You are a helpful assistant. Answer briefly."
ANSWER_SCHEMA = {"type": "string", "maxLength": 40}
# docs/agents.md's config.toml for Codex, and (after the blank line) what this test adds for
# the 135M model: a short instructions file, no tools
CODEX_CONFIG = """\
model = "default"
model_provider = "anchorcache"
check_for_update_on_startup = false
web_search = "disabled"
model_context_window = 8192

[model_providers.anchorcache]
name = "anchorcache"
base_url = "{url}/v1"
env_key = "ANCHORCACHE_API_KEY"
wire_api = "responses"

[analytics]
enabled = false

[features]
shell_tool = false
unified_exec = false
view_image = false
goals = false
apps = false
plugins = false

[agents]
enabled = false

[skills]
include_instructions = false

[skills.bundled]
enabled = false

[tools]
experimental_request_user_input = {{ enabled = false }}
"""


def installed(binary: Path) -> Path:
    if not binary.exists():  # a missing client is a failure, never a skip
        need = "" if shutil.which("npm") else " (it needs node and npm, not on this machine)"
        pytest.fail(f"{binary.name} is not in {AGENT_CLIS}: run `make agent-clis`{need}")
    return binary


def metric(proxy: Server, name: str, **labels: str) -> float:
    text = httpx.get(proxy.url + "/metrics", timeout=30).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture()
def fresh(worker: Server):
    """A proxy of its own (its own ledger and metrics) in front of the session's worker."""
    with proxy_process(worker.url) as server:
        yield server


def test_codex_exec_answers_and_restores_its_anchors(fresh: Server, tmp_path: Path):
    codex = installed(CODEX)
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "instructions.md").write_text(INSTRUCTIONS + "\n")
    (home / "config.toml").write_text(
        f'model_instructions_file = "{home / "instructions.md"}"\n'
        + CODEX_CONFIG.format(url=fresh.url))
    schema = tmp_path / "answer.json"
    schema.write_text(json.dumps(ANSWER_SCHEMA))

    def turn(*args: str) -> dict:
        done = subprocess.run(
            [str(codex), "exec", "--json", "--strict-config", "--skip-git-repo-check",
             "--sandbox", "read-only", "--output-schema", str(schema), *args],
            cwd=work, env={**os.environ, "CODEX_HOME": str(home), "ANCHORCACHE_API_KEY": "EMPTY"},
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
        events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
        [answer] = [e["item"]["text"] for e in events if e["type"] == "item.completed"
                    and e["item"]["type"] == "agent_message"]
        assert isinstance(json.loads(answer), str)  # the schema's JSON string
        [usage] = [e["usage"] for e in events if e["type"] == "turn.completed"]
        return usage

    first = turn("Say hi.")
    assert first["input_tokens"] > 40 and first["cached_input_tokens"] == 0
    # a new session, another question: the instructions (developer messages) restore
    second = turn("What is two plus two?")
    assert 0 < second["cached_input_tokens"] < second["input_tokens"]
    assert metric(fresh, "anchorcache_anchor_hits_total", kind="instruction") == 1
    assert metric(fresh, "anchorcache_prompt_tokens_total", source="restored") \
        == second["cached_input_tokens"]
    # the session's next turn: its whole history restores
    third = turn("resume", "--last", "And now say bye.")
    assert third["input_tokens"] > second["input_tokens"]
    assert third["cached_input_tokens"] >= 0.9 * second["input_tokens"]
    assert metric(fresh, "anchorcache_anchor_hits_total", kind="conversation") >= 1
