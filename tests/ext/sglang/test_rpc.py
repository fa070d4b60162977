"""The scheduler RPC transport (ext/sglang/rpc.py) against a stand-in scheduler that speaks
SGLang's own RPC messages over zmq. The stand-in exists for the faults a real scheduler
cannot be made to produce on demand: an answer that comes after its caller gave up, and a
refused RPC. Everything else about the RPC is exercised by the real SGLang tests."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
import pytest
import zmq
import zmq.asyncio
from sglang.srt.managers.io_struct import (
    RpcReqOutput,
    async_sock_recv,
    async_sock_send,
)

from anchorcache.ext.sglang.rpc import SchedulerError, SchedulerRpc


class Scheduler:
    """Runs `tree_cache` calls one at a time in arrival order, as SGLang's scheduler does:
    our reply on the caller's PULL socket, then SGLang's acknowledgement. Op `slow` takes
    `slow_s`; op `refuse` fails the RPC itself (no reply, a failed acknowledgement)."""

    def __init__(self, ipc: str, slow_s: float) -> None:
        self.ipc, self.slow_s = ipc, slow_s
        self.ctx = zmq.asyncio.Context()
        self.ran: list[int] = []

    async def serve(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.ipc)
        pushes: dict[str, zmq.asyncio.Socket] = {}
        while True:
            p = (await async_sock_recv(sock)).parameters
            if p["op"] == "slow":
                await asyncio.sleep(self.slow_s)
            if p["op"] == "refuse":
                await async_sock_send(sock, RpcReqOutput(success=False, message="no such op"))
                continue
            push = pushes.get(p["reply_to"])
            if push is None:
                push = pushes[p["reply_to"]] = self.ctx.socket(zmq.PUSH)
                push.connect(p["reply_to"])
            self.ran.append(p["call_id"])
            await push.send(orjson.dumps({"ok": True, "op": p["op"], "call_id": p["call_id"],
                                          "body": orjson.loads(p["payload"]), "epoch": "e1"}))
            await async_sock_send(sock, RpcReqOutput(success=True, message=""))


@contextlib.asynccontextmanager
async def running(tmp_path, slow_s=0.5):
    rpc = SchedulerRpc(f"ipc://{tmp_path}/rpc")
    scheduler = Scheduler(rpc.rpc_ipc_name, slow_s)
    task = asyncio.create_task(scheduler.serve())
    try:
        yield rpc, scheduler
    finally:
        task.cancel()
        for reader in rpc._readers:
            reader.cancel()
        await asyncio.gather(task, *rpc._readers, return_exceptions=True)
        scheduler.ctx.destroy(linger=0)
        if rpc._ctx is not None:
            rpc._ctx.destroy(linger=0)


async def test_a_late_reply_never_answers_a_later_call(tmp_path):
    async with running(tmp_path) as (rpc, scheduler):
        with pytest.raises(asyncio.TimeoutError):
            await rpc.call("slow", {"n": 1}, timeout_s=0.05)
        # the slow call still runs on the scheduler, and answers while this one waits
        reply = await rpc.call("fast", {"n": 2})
        assert reply == {"op": "fast", "body": {"n": 2}, "epoch": "e1"}
        assert scheduler.ran == [1, 2]
        for _ in range(100):  # the acknowledgements come after the replies
            if not rpc._unacked:
                break
            await asyncio.sleep(0.01)
        assert rpc._waiting == {} and not rpc._unacked


async def test_overlapping_calls_each_get_their_own_reply(tmp_path):
    async with running(tmp_path) as (rpc, _):
        replies = await asyncio.gather(*(rpc.call("op", {"n": i}) for i in range(16)))
        assert [r["body"]["n"] for r in replies] == list(range(16))


async def test_a_refused_rpc_fails_its_own_call_only(tmp_path):
    async with running(tmp_path, slow_s=0.2) as (rpc, _):
        slow = asyncio.create_task(rpc.call("slow", {"n": 0}))
        refused = asyncio.create_task(rpc.call("refuse", {}))
        after = asyncio.create_task(rpc.call("fast", {"n": 1}))
        with pytest.raises(SchedulerError, match="no such op"):
            await refused
        assert (await slow)["body"] == {"n": 0}
        assert (await after)["body"] == {"n": 1}
        # a refusal whose caller gave up fails nobody else
        with pytest.raises(asyncio.TimeoutError):
            await rpc.call("slow", {}, timeout_s=0.01)
        gone = asyncio.create_task(rpc.call("refuse", {}, timeout_s=0.01))
        with pytest.raises(asyncio.TimeoutError):
            await gone
        assert (await rpc.call("fast", {"n": 2}))["body"] == {"n": 2}
