"""The RPC transport from SGLang's HTTP process to its scheduler's loop.

A call travels on SGLang's own RPC socket (`RpcReqInput(method="tree_cache")` →
`Scheduler.handle_rpc_request` → `AnchorRadixCache.__call__` on the scheduler's loop). The
scheduler runs RPCs in the order they arrive and answers each one twice, in that order:
our reply, tagged with the call's id, on our own PULL socket (`RpcReqOutput` carries only
success and a message), then SGLang's acknowledgement on the RPC socket.

Calls may overlap. One reader per socket hands each message to its call: replies by call
id, acknowledgements by order (they carry no id, but come in send order). A reply or an
acknowledgement whose call timed out or went away finds no waiter and is dropped, so it
can never answer a later call (a single lock with a receive after each send would hand a
late reply to the next caller).

Tensor parallelism: SGLang hands every RPC to every TP rank's scheduler, in the same order
(rank 0 receives it and broadcasts it), and each rank keeps its own anchor store over its own
shard of the KV heads. Only rank 0 pushes our reply (one reply per call), and every call
carries `now`, the caller's clock, which the stores use for their staged TTL instead of their
own clocks: every decision a store makes then depends on the call sequence alone, so all
ranks verify, restore, evict and expire the same anchors.

One round trip per request: a request's anchor plan is not a call. It rides in the
request's own sampling parameters (`custom_params[PLAN_PARAM]`, a JSON string, which SGLang
hands every TP rank with the request), and the scheduler pushes the request's report when
it releases the request's KV (`{"push": "finish", "token", ...}` on the same PULL socket,
taken by `expect(token)`). The proxy's `/anchor/confirm` is then the request's one call.
A request that fails, or whose report does not come, ends with the `finish` call.

Data parallelism (`--dp-size N`): each data-parallel rank is its own scheduler (with its own
TP group, tree, anchor store and epoch), and SGLang gives each rank's scheduler an RPC socket
of its own, under a random name that only its DP controller knows. With `RANK_RPC_DIR` set
(by our launcher, for every SGLang process it starts), each rank's scheduler connects to
`rank_rpc_name(dp_rank)` instead (the plugin's hook around `Scheduler.init_ipc_channels`),
so the HTTP process reaches rank k through one `SchedulerRpc` per rank, as it reaches the one
scheduler without DP.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import zmq
import zmq.asyncio

log = logging.getLogger("anchorcache.sglang")

RPC_TIMEOUT_S = 120.0
PLAN_PARAM = "anchorcache_plan"  # the custom_params key of a request's anchor plan
RANK_RPC_DIR = "ANCHORCACHE_RANK_RPC_DIR"  # the folder of the DP ranks' RPC sockets


def rank_rpc_name(dp_rank: int | None) -> str | None:
    """Data-parallel rank `dp_rank`'s scheduler RPC socket (module docstring), or None: no
    data parallelism (SGLang's own socket name is used)."""
    folder = os.environ.get(RANK_RPC_DIR)
    if not folder or dp_rank is None:
        return None
    return f"ipc://{Path(folder) / f'rpc-dp{int(dp_rank)}'}"


class SchedulerError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class SchedulerRpc:
    """Calls `AnchorRadixCache.__call__` on the scheduler's loop; see the module docstring.

    `call` raises SchedulerError (the scheduler's 4xx/5xx, or its refusal of the RPC) and
    asyncio.TimeoutError past `timeout_s`; a timed-out call may still run on the scheduler."""

    def __init__(self, rpc_ipc_name: str) -> None:
        self.rpc_ipc_name = rpc_ipc_name
        # a directory only this process may enter: nobody else can bind the reply path first
        self._dir = Path(tempfile.mkdtemp(prefix="anchorcache-rpc-"))
        self.reply_to = f"ipc://{self._dir / 'reply'}"
        self._ctx: zmq.asyncio.Context | None = None
        self._dealer: Any = None
        self._pull: Any = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._pushed: dict[str, asyncio.Future[dict[str, Any]]] = {}  # by run token
        self._unacked: collections.deque[int] = collections.deque()  # call ids, send order
        self._readers: list[asyncio.Task[None]] = []

    def _open(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.bind(self.rpc_ipc_name)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self.reply_to)
        self._readers = [asyncio.create_task(self._read_replies()),
                         asyncio.create_task(self._read_acks())]

    async def call(self, op: str, body: dict[str, Any],
                   timeout_s: float = RPC_TIMEOUT_S) -> dict[str, Any]:
        from sglang.srt.managers.io_struct import RpcReqInput, async_sock_send

        if self._ctx is None:
            self._open()
        call_id = next(self._ids)
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = reply
        # `now`: the call's time, one clock for every tensor-parallel rank (module docstring)
        params = {"op": op, "payload": orjson.dumps(body).decode(),
                  "reply_to": self.reply_to, "call_id": call_id, "now": time.monotonic()}
        try:
            self._unacked.append(call_id)
            try:
                await async_sock_send(self._dealer, RpcReqInput(method="tree_cache",
                                                                parameters=params))
            except BaseException:
                self._unacked.remove(call_id)  # never sent: no acknowledgement will come
                raise
            out = await asyncio.wait_for(reply, timeout_s)
        finally:
            self._waiting.pop(call_id, None)
        if not out.pop("ok"):
            raise SchedulerError(int(out.get("status", 500)), str(out.get("message")))
        out.pop("call_id", None)
        return out

    async def _read_replies(self) -> None:
        while True:
            raw = await self._pull.recv()
            try:
                reply = orjson.loads(raw)
                waiter = (self._pushed.pop(str(reply.get("token")), None) if "push" in reply
                          else self._waiting.get(reply.get("call_id")))
            except (orjson.JSONDecodeError, AttributeError, TypeError):
                log.error("unreadable scheduler reply dropped: %.200r", raw)
                continue
            if waiter is not None and not waiter.done():
                waiter.set_result(reply)
            # else: its call timed out or went away (or its run ended); dropped

    def expect(self, token: str) -> asyncio.Future[dict[str, Any]]:
        """The report the scheduler will push when run `token`'s request is released."""
        if self._ctx is None:
            self._open()
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pushed[token] = fut
        return fut

    def forget(self, token: str) -> None:
        self._pushed.pop(token, None)

    async def _read_acks(self) -> None:
        from sglang.srt.managers.io_struct import async_sock_recv

        while True:
            done = await async_sock_recv(self._dealer)
            call_id = self._unacked.popleft() if self._unacked else None
            waiter = self._waiting.get(call_id) if call_id is not None else None
            # success is already known from our reply; a refusal comes without one
            if not done.success and waiter is not None and not waiter.done():
                waiter.set_exception(SchedulerError(
                    500, f"scheduler RPC failed: {done.message}"))
