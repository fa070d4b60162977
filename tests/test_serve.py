"""The README's main job: `anchorcache serve` answers the openai SDK and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai
import psutil
import pytest

from anchorcache.cli import free_port, wait_ready

pytestmark = pytest.mark.slow


def test_serve_answers_and_stops_both_processes_on_sigterm(default_model_dir, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "anchorcache.cli", "serve", "--port", str(port),
                             "--threads", "2", "--log-level", "warning"],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                 "ANCHORCACHE_STATE_DIR": str(tmp_path)})
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout_s=300)
        # no key: the anonymous tenant (on by default on loopback)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="", max_retries=0)
        reply = client.chat.completions.create(
            model="default", temperature=0, max_tokens=20,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children  # the embedded worker
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _gone, alive = psutil.wait_procs(children, timeout=30)
        assert alive == []
        assert f"http://127.0.0.1:{port}/v1" in proc.stdout.read()
        assert (tmp_path / "ledger.sqlite3").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
