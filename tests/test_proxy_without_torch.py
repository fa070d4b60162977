"""The proxy runs on a CPU box with no GPU stack: its dependencies
(pyproject's base list, `pip install 'anchorcache[proxy]'`) name no worker library, and every
module of the proxy, the ledger and the operator CLI imports, a chat splits and `anchorcache
proxy --help` runs with torch, SGLang and the workers' other libraries hidden from the import
system. (README: the install checked for real in a fresh venv, with a chat answered.)"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER_ONLY = ("torch", "sglang", "transformers", "xgrammar", "safetensors", "accelerate",
               "gguf")
# sys.modules[name] = None: the import system (and find_spec) sees no such package
HIDE = f"import sys\nfor name in {WORKER_ONLY!r}:\n    sys.modules[name] = None\n"
IMPORT_ALL = HIDE + f"WORKER_ONLY = {WORKER_ONLY!r}\n" + """
import importlib, pkgutil
import anchorcache.cli, anchorcache.proxy, anchorcache.state, anchorcache.ops
count = 0
for pkg in (anchorcache.proxy, anchorcache.state, anchorcache.ops):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(info.name)
        count += 1
from anchorcache.proxy.splitter import get_adapter
from anchorcache.proxy.splitter.tokenizers import load_tokenizer
split = get_adapter("auto", load_tokenizer("qwen3")).split(
    [{"role": "user", "content": "hi"}], [{"type": "function", "function": {"name": "f"}}])
assert not any(sys.modules.get(n) for n in WORKER_ONLY)
print(count, len(split.input_ids), len(split.cuts))
"""


def _base_dependencies() -> list[str]:
    tomllib = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["proxy"] == []  # the install line's name
    return project["dependencies"]


def test_the_proxy_install_names_no_worker_library():
    names = {re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower() for d in _base_dependencies()}
    assert not names & set(WORKER_ONLY), names & set(WORKER_ONLY)


def test_the_proxy_imports_and_splits_without_the_worker_libraries():
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    modules, num_tokens, num_cuts = map(int, done.stdout.split())
    assert modules > 30 and num_tokens > 10 and num_cuts >= 1


def test_anchorcache_proxy_help_runs_without_the_worker_libraries():
    script = HIDE + ("sys.argv = ['anchorcache', 'proxy', '--help']\n"
                     "from anchorcache.cli import main\nmain()")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "--worker" in done.stdout
