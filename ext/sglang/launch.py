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


if __name__ == "__main__":
    main(sys.argv[1:])
