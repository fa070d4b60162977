"""`make serve` does not install SGLang: `--backend sglang` without it says how to get it
(`make setup-sglang`) and exits 2, instead of an ImportError traceback from the worker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# sys.modules[name] = None: the import system (and find_spec) sees no such package
WITHOUT_SGLANG = ("import sys; sys.modules['sglang'] = None; sys.argv = ['anchorcache', *sys.argv[1:]]; "
                  "from anchorcache.cli import main; main()")


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_backend_sglang_without_sglang_says_how_to_get_it(command, tmp_path):
    done = subprocess.run([sys.executable, "-c", WITHOUT_SGLANG, command, "--backend", "sglang",
                           "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "make setup-sglang" in done.stderr and "sglang==0.5.23" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize("command", ["proxy", "serve"])
def test_a_short_admin_token_is_a_usage_error(command, tmp_path):
    """Under 16 characters: one line naming the rule, exit 2, before any worker starts."""
    model = ["--model", str(tmp_path)] if command == "serve" else []  # (never loaded)
    done = subprocess.run([sys.executable, "-m", "anchorcache.cli", command, "--admin-token",
                           "short", "--state-dir", str(tmp_path), *model],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "at least 16 characters" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize("secret, says", [(None, "needs --worker-secret"),
                                          ("short", "at least 16 characters")])
def test_a_worker_beyond_loopback_needs_a_worker_secret(secret, says, tmp_path):
    """Anyone on the network could flush, pin or generate: refused before the model loads."""
    env = {k: v for k, v in os.environ.items() if k != "ANCHORCACHE_WORKER_SECRET"}
    if secret is not None:
        env["ANCHORCACHE_WORKER_SECRET"] = secret
    done = subprocess.run([sys.executable, "-m", "anchorcache.cli", "worker", "--host",
                           "0.0.0.0", "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
