"""How SGLang 0.5.23 serves on a machine without a GPU (the "CPU recipe").

Three things (measured; /work/shared/notes/offline-components.md): the CPU engine switch
`SGLANG_USE_CPU_ENGINE=1`; a stub `libcuda.so.1` on `LD_LIBRARY_PATH`, because the
CUDA-only kernel wheel imports one driver symbol; and the CPU flags below. The stub is
compiled from `stub_libcuda.c` into the anchorcache cache dir, once per source version.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

STUB_SOURCE = Path(__file__).with_name("stub_libcuda.c")
# SGLang arguments for CPU serving; an explicit user argument of the same name wins
CPU_ARGS = {"--device": "cpu", "--attention-backend": "torch_native",
            "--mem-fraction-static": "0.95", "--max-total-tokens": "4096"}
CPU_FLAGS = ("--disable-cuda-graph",)


def has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def build_stub_libcuda(out_dir: Path | None = None) -> Path:
    """Compile the stub into `<cache>/sglang-stub-<hash>/libcuda.so.1` (once); its folder."""
    from anchorcache.paths import cache_dir

    digest = hashlib.sha256(STUB_SOURCE.read_bytes()).hexdigest()[:12]
    folder = out_dir or cache_dir() / f"sglang-stub-{digest}"
    lib = folder / "libcuda.so.1"
    if lib.is_file():
        return folder
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc/cc) to build the stub libcuda.so.1")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / "libcuda.so.1"
        subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(built), str(STUB_SOURCE)],
                       check=True)
        os.replace(built, lib)  # atomic: a concurrent build never leaves half a library
    return folder


def cpu_env(base: dict[str, str]) -> dict[str, str]:
    """`base` plus the CPU engine switch and the stub on the library path."""
    stub = str(build_stub_libcuda())
    path = base.get("LD_LIBRARY_PATH")
    return {**base, "SGLANG_USE_CPU_ENGINE": "1",
            "LD_LIBRARY_PATH": stub + (os.pathsep + path if path else "")}


def with_cpu_args(args: list[str]) -> list[str]:
    """SGLang arguments plus the CPU ones the user did not give."""
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    out = list(args)
    for name, value in CPU_ARGS.items():
        if name not in given:
            out += [name, value]
    out += [f for f in CPU_FLAGS if f not in given]
    return out


def sglang_command(python: str, *, model: str, host: str, port: int, log_level: str,
                   extra: list[str], gpu: bool) -> list[str]:
    """The command line of the SGLang worker process (our launcher + SGLang's arguments)."""
    args = ["--model-path", model, "--host", host, "--port", str(port),
            "--radix-cache-backend", "anchorcache", "--skip-server-warmup",
            "--log-level", log_level, *extra]
    if not gpu:
        args = with_cpu_args(args)
    return [python, "-m", "anchorcache.ext.sglang.launch", *args]
