"""The SGLang worker's state in SGLang's HTTP process: the scheduler RPC, the worker's
epoch (the scheduler's, learnt from every reply), and the limits a request must fit.

With SGLang's data parallelism (`--dp-size N`) there is one `SGLangWorker` per rank, each
with its own RPC to its own rank's scheduler (ext/sglang/rpc.py) and its own epoch; they
share SGLang's one tokenizer manager, and `peers` lists them all."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Protocol

from anchorcache.wire import GenerateRequest, WireError

from .rpc import SchedulerError, SchedulerRpc, rank_rpc_name


class RunningRequest(Protocol):
    """What the worker's table of running requests offers the contract routes (a `run.Run`)."""

    def sglang_rids(self) -> list[str]: ...

    async def stop(self, output_tokens: int | None) -> bool: ...


class SGLangWorker:
    """What the contract routes need in SGLang's HTTP process."""

    def __init__(self, model_path: str, dp_rank: int | None = None) -> None:
        self.model_path = model_path
        self.model_id = Path(model_path).name
        self.dp_rank = dp_rank  # SGLang's data-parallel rank this worker addresses (None: no DP)
        self.peers: list[SGLangWorker] = [self]  # every rank's worker, this one included
        self.rpc: SchedulerRpc | None = None
        self.epoch: str | None = None
        self.pin_budget_tokens = 0  # the scheduler's (hello): kept out of every request
        # running contract requests by rid: a run enters with `started`, leaves with `ended`
        self.runs: dict[str, RunningRequest] = {}

    @staticmethod
    def ranks(model_path: str, dp_size: int) -> list[SGLangWorker]:
        """The workers of a server with `dp_size` data-parallel ranks (one, unranked, for 1)."""
        if dp_size <= 1:
            return [SGLangWorker(model_path)]
        workers = [SGLangWorker(model_path, k) for k in range(dp_size)]
        for w in workers:
            w.peers = workers
        return workers

    def connect(self, port_args: Any) -> None:
        """Set up the RPC to this worker's scheduler (`port_args`: SGLang's, of the server)."""
        self.rpc = SchedulerRpc(rank_rpc_name(self.dp_rank) or port_args.rpc_ipc_name)

    def started(self, rid: str, run: RunningRequest) -> None:
        self.runs[rid] = run

    def ended(self, rid: str) -> None:
        self.runs.pop(rid, None)

    def learn_epoch(self, reply: dict[str, Any]) -> None:
        """Take the scheduler's epoch from a reply that carries one (a pushed report)."""
        self.epoch = reply.get("epoch", self.epoch)

    @property
    def tm(self) -> Any:
        from sglang.srt.entrypoints.http_server import get_global_state

        return get_global_state().tokenizer_manager

    async def call(self, op: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.rpc is None:
            raise SchedulerError(503, "the scheduler RPC channel is not set up")
        reply = await self.rpc.call(op, body or {})
        self.epoch = reply.pop("epoch", self.epoch)
        return reply

    def expect(self, token: str) -> asyncio.Future[dict[str, Any]]:
        """The report the scheduler pushes when run `token`'s request is released."""
        if self.rpc is None:
            raise SchedulerError(503, "the scheduler RPC channel is not set up")
        return self.rpc.expect(token)

    def forget(self, token: str) -> None:
        if self.rpc is not None:
            self.rpc.forget(token)

    async def ready(self) -> bool:
        if self.epoch is None:
            try:
                hello = await self.call("hello")
            except (SchedulerError, asyncio.TimeoutError):
                return False
            self.pin_budget_tokens = int(hello.get("pin_budget_tokens", 0))
        return self.epoch is not None

    def max_request_tokens(self) -> int:
        """Prompt + completion tokens one request may have: the model's context, or less
        when SGLang's KV pool is smaller (SGLang refuses prompts of `max_req_input_len`
        tokens), less the share of the pool pinned anchors may lock (so a request that is
        admitted always fits beside them)."""
        tm = self.tm
        limit = int(tm.context_len)
        pool = getattr(tm, "max_req_input_len", None)
        if pool:
            limit = min(limit, int(pool) - self.pin_budget_tokens)
        return limit

    def check_input(self, req: GenerateRequest) -> None:
        """WireError (400) for a request SGLang could not serve whole: over the context or
        the pool, or ids outside the vocabulary."""
        limit = self.max_request_tokens()
        if len(req.input_ids) + req.sampling.max_new_tokens > limit:
            raise WireError(f"prompt ({len(req.input_ids)} tokens) + max_new_tokens "
                            f"({req.sampling.max_new_tokens}) exceeds the context of {limit} "
                            f"tokens (the model's context or what SGLang's KV pool holds for "
                            f"one request, whichever is smaller)")
        vocab = int(self.tm.model_config.hf_config.vocab_size)
        if min(req.input_ids) < 0 or max(req.input_ids) >= vocab:
            raise WireError(f"input_ids must lie in [0, {vocab}) (the model's vocabulary)")
