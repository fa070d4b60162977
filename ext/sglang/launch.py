"""`python -m anchorcache.ext.sglang.launch SGLANG_ARGS...`: SGLang's HTTP server with the
worker contract on it. `anchorcache worker --backend sglang` builds the arguments and the
environment (the CPU recipe, the anchor settings) and runs this module.

It does what `python -m sglang.launch_server` does (load plugins, parse SGLang's own
arguments, `launch_server`), plus two official `launch_server` parameters' worth of
wiring: the contract routes go onto SGLang's FastAPI app, and SGLang's tokenizer-manager
factory is wrapped to learn the scheduler's RPC socket name.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    # the contract's logprobs are the model's own distribution, before temperature and
    # truncation (SGLang's default returns the processed one when sampling)
    os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    from sglang.srt.entrypoints.http_server import app, launch_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from .http import SGLangWorker, install

    load_plugins()
    server_args = prepare_server_args(argv)
    worker = SGLangWorker(server_args.model_path)
    install(app, worker)
    try:
        launch_server(server_args, init_tokenizer_manager_func=worker.init_tokenizer_manager)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
