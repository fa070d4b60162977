"""Every SGLang name we rely on (the table in docs/sglang.md) exists at the pinned version.
SGLang's modules need the CPU recipe at import (the stub libcuda.so.1), so the names are
resolved in a subprocess with that environment."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from anchorcache.ext.sglang import cpu

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]

RESOLVE = r'''
import importlib, inspect, json, re, sys

# (modules that bind SGLang's CPU kernels at import, the GDN backend's, need the CPU
# recipe's reference kernels registered first, as the worker's scheduler has them)
from anchorcache.ext.sglang import cpu_kernels
cpu_kernels.install()

def has(obj, attr):
    if hasattr(obj, attr):
        return True
    if not inspect.isclass(obj):
        return False
    assign = re.compile(r"self\.%s\s*(:[^=\n]*)?=[^=]" % re.escape(attr))
    for cls in obj.__mro__:
        try:
            if assign.search(inspect.getsource(cls)):
                return True
        except (OSError, TypeError):
            pass
    return False

missing = []
for name in json.loads(sys.argv[1]):
    module, _, path = name.partition(":")
    try:
        obj = importlib.import_module(module)
        parts = path.split(".")
        for i, attr in enumerate(parts):
            if inspect.ismodule(obj) and not hasattr(obj, attr):  # (a submodule?)
                try:
                    importlib.import_module(f"{obj.__name__}.{attr}")
                except ImportError:
                    pass
            if i == len(parts) - 1 and not hasattr(obj, attr):
                if not has(obj, attr):
                    raise AttributeError(attr)
                break
            obj = getattr(obj, attr)
    except Exception as e:
        missing.append(f"{name}: {type(e).__name__}: {e}")
print(json.dumps(missing))
'''


def documented_names() -> list[str]:
    doc = (ROOT / "docs" / "sglang.md").read_text()
    table = doc.split("<!-- sglang-names -->")[1].split("<!-- /sglang-names -->")[0]
    return re.findall(r"^\| `([\w.]+:[\w.]+)` \|", table, flags=re.M)


def test_every_documented_sglang_name_resolves_at_the_pinned_version():
    names = documented_names()
    assert len(names) >= 40
    env = cpu.cpu_env({**os.environ, "PYTHONPATH": str(ROOT)})
    proc = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps(names)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_every_sglang_import_in_ext_is_documented():
    """A new `from sglang... import X` in ext/sglang/ needs its row in the table."""
    used = set()
    for path in (ROOT / "ext" / "sglang").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
                used |= {f"{node.module}:{alias.name}" for alias in node.names}
    assert len(used) >= 20
    assert used - set(documented_names()) == set()
