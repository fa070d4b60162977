"""The client SDKs a newcomer installs today (openai >= 3, anthropic >= 2), against a fresh
proxy and the real default-model worker: the README's examples as written, placeholder API
keys before the first tenant, a 401 that says how to get a key after it.

The venv's openai is SGLang's pin (2.8), which still sends an empty key; the current SDKs
live beside it in `.venv/current-sdk` (`make current-sdk`, part of `make test`) and run in a
subprocess with that folder first on PYTHONPATH.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from anchorcache.testing.inprocess import proxy_in_process
from anchorcache.testing.sdk import run_client
from anchorcache.testing.servers import ADMIN_TOKEN, Endpoint, Server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README_URL = "http://127.0.0.1:8000"
HI = [{"role": "user", "content": "Say hi."}]
def readme_examples(url: str) -> list[str]:
    """The README's Python examples, pointed at `url`."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 2 and README_URL in blocks[0]
    return [b.replace(README_URL, url) for b in blocks[:2]]


def chat(proxy: Endpoint, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(proxy.url + "/v1/chat/completions", headers=headers, timeout=300,
                      json={"model": "default", "messages": HI, "max_tokens": 2})


@pytest.fixture()
def fresh(worker: Server) -> Iterator[Endpoint]:
    """A proxy with a ledger of its own: no tenant yet, as after `make serve` (in this
    process: the SDKs' subprocess reaches it by URL)."""
    with proxy_in_process(worker.url) as server:
        yield server


def test_the_readme_examples_run_as_written_with_the_current_sdks(fresh: Endpoint):
    done = run_client("\n".join(readme_examples(fresh.url)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("Paris") >= 2, done.stdout  # the OpenAI and the Anthropic answer


def test_placeholder_keys_until_the_first_tenant_then_a_401_with_a_hint(fresh: Endpoint):
    before = run_client(f"""
        import anthropic, openai
        client = openai.OpenAI(base_url="{fresh.url}/v1", api_key="EMPTY", max_retries=0)
        reply = client.chat.completions.create(model="default", max_tokens=2, messages={HI!r})
        print("openai served", reply.usage.completion_tokens > 0)
        claude = anthropic.Anthropic(base_url="{fresh.url}", api_key="sk-no-key", max_retries=0)
        reply = claude.messages.create(model="default", max_tokens=2, messages={HI!r})
        print("anthropic served", reply.usage.output_tokens > 0)
    """)
    assert before.returncode == 0, before.stderr
    assert "openai served True" in before.stdout, before.stdout
    assert "anthropic served True" in before.stdout
    # the placeholder keys ran as the anonymous tenant, as no key does: nothing else exists
    tenants = httpx.get(fresh.url + "/admin/tenants", timeout=30,
                        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()["data"]
    assert [t["name"] for t in tenants] == ["anonymous"]

    made = httpx.post(fresh.url + "/admin/tenants", json={"name": "acme"}, timeout=30,
                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert made.status_code == 200, made.text
    key = made.json()["api_key"]
    after = run_client(f"""
        import anthropic, openai
        client = openai.OpenAI(base_url="{fresh.url}/v1", api_key="EMPTY", max_retries=0)
        try:
            client.chat.completions.create(model="default", max_tokens=2, messages={HI!r})
        except openai.AuthenticationError as e:
            print("openai refused", e.status_code, e.body["code"], e.body["message"])
        claude = anthropic.Anthropic(base_url="{fresh.url}", api_key="EMPTY", max_retries=0)
        try:
            claude.messages.create(model="default", max_tokens=2, messages={HI!r})
        except anthropic.AuthenticationError as e:
            print("anthropic refused", e.status_code)
        tenant = openai.OpenAI(base_url="{fresh.url}/v1", api_key="{key}", max_retries=0)
        reply = tenant.chat.completions.create(model="default", max_tokens=2, messages={HI!r})
        print("tenant served", reply.usage.completion_tokens > 0)
    """)
    assert after.returncode == 0, after.stderr
    assert "openai refused 401 invalid_api_key" in after.stdout, after.stdout
    assert "anchorcache ops tenant-add NAME" in after.stdout  # the hint
    assert "anthropic refused 401" in after.stdout
    assert "tenant served True" in after.stdout
    assert chat(fresh, None).status_code == 200  # no key: still the anonymous tenant


def test_strict_keys_refuse_placeholder_keys_from_the_start(worker: Server):
    with proxy_in_process(worker.url, strict_keys=True) as strict:
        refused = chat(strict, "EMPTY")
        assert refused.status_code == 401
        error = refused.json()["error"]
        assert error["code"] == "invalid_api_key"
        assert "anchorcache ops tenant-add NAME" in error["message"]
        assert "send no key" in error["message"]  # anonymous access is on (loopback)
        assert chat(strict, None).status_code == 200
