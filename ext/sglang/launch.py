"""`python -m anchorcache.ext.sglang.launch SGLANG_ARGS...`: SGLang's HTTP server with the
worker contract on it. `anchorcache worker --backend sglang` builds the arguments and the
environment (the CPU recipe, the anchor settings) and runs this module.

It does what `python -m sglang.launch_server` does (load plugins, parse SGLang's own
arguments, `launch_server`), plus two official `launch_server` parameters' worth of
wiring: the contract routes go onto SGLang's FastAPI app, and SGLang's tokenizer-manager
factory is wrapped to learn the scheduler's RPC socket name. With `--dp-size N` each rank's
scheduler gets its RPC socket in a folder of ours (ext/sglang/rpc.py, `RANK_RPC_DIR`, which
every SGLang process inherits), and each rank's contract is served under `/dp/K`.

The worker secret (`ANCHORCACHE_WORKER_SECRET`, never a command-line argument) becomes
SGLang's own API key, whose middleware guards every route of the app, ours and SGLang's
alike, but its health, readiness and metrics probes.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any


def main(argv: list[str]) -> None:
    # the contract's logprobs are the model's own distribution, before temperature and
    # truncation (SGLang's default returns the processed one when sampling)
    os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    from sglang.srt.entrypoints.engine import init_tokenizer_manager
    from sglang.srt.entrypoints.http_server import app, launch_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from anchorcache.wire import WORKER_SECRET_ENV

    from .http import SGLangWorker, install
    from .rpc import RANK_RPC_DIR

    load_plugins()
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":  # the CPU recipe (ext/sglang/cpu.py)
        _fork_children()
    server_args = prepare_server_args(argv)
    secret = os.environ.pop(WORKER_SECRET_ENV, None)
    if secret:
        if server_args.api_key not in (None, secret):
            raise SystemExit("error: give the worker secret or SGLang's --api-key, not both")
        server_args.api_key = secret
    dp_size = int(getattr(server_args, "dp_size", 1) or 1)
    if dp_size > 1:
        os.environ[RANK_RPC_DIR] = tempfile.mkdtemp(prefix="anchorcache-dp-")
    workers = SGLangWorker.ranks(server_args.model_path, dp_size)
    install(app, workers)

    def tokenizer_manager(server_args: object, port_args: object, *args: object) -> object:
        for worker in workers:
            worker.connect(port_args)
        return init_tokenizer_manager(server_args, port_args, *args)

    try:
        launch_server(server_args, init_tokenizer_manager_func=tokenizer_manager)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def _fork_children() -> None:
    """SGLang's children (each rank's scheduler, the detokenizer, the data-parallel
    controller) start by fork instead of spawn, on the CPU engine only (CUDA cannot be
    forked into; on a GPU SGLang's spawn stays). A spawned child imports SGLang, torch and
    our plugin again, ~11 s of CPU each: a start took 30-38 s and 45-50 s of CPU on a 2-core
    machine, forked 21-23 s and 24-27 s (same tokens). This process has loaded no model and
    run no torch op yet when SGLang starts them (`_launch_subprocesses`), and the children
    inherit the plugin's hooks as loaded here. SGLang sets "spawn" in
    `_set_envs_and_config`, which `_launch_subprocesses` calls first: this sets "fork"
    right after it."""
    import importlib
    import multiprocessing as mp

    engine: Any = importlib.import_module("sglang.srt.entrypoints.engine")
    configure = engine._set_envs_and_config

    def set_envs_and_config(server_args: object) -> None:
        configure(server_args)
        mp.set_start_method("fork", force=True)

    engine._set_envs_and_config = set_envs_and_config


if __name__ == "__main__":
    main(sys.argv[1:])
