"""The client SDKs a newcomer installs today (openai >= 3, anthropic >= 2), run in a
subprocess: the venv's openai is SGLang's pin (2.8), so the current SDKs live beside it in
`<venv>/current-sdk` (`make current-sdk`, part of `make test`), first on PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

CURRENT_SDK = Path(sys.prefix) / "current-sdk"
VERSIONS = """
import anthropic, openai
print("versions", openai.__version__, anthropic.__version__)
assert int(openai.__version__.split(".")[0]) >= 3, openai.__version__
assert int(anthropic.__version__.split(".")[0]) >= 2, anthropic.__version__
"""


def run_client(script: str) -> subprocess.CompletedProcess[str]:
    """`script` under the current SDKs (their versions checked first); it fails the test if
    they are not installed."""
    import pytest

    if not (CURRENT_SDK / ".installed").exists():
        pytest.fail(f"the current client SDKs are not in {CURRENT_SDK}: run `make current-sdk`")
    env = {**os.environ, "PYTHONPATH": str(CURRENT_SDK)}
    return subprocess.run([sys.executable, "-c", VERSIONS + textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=600)
