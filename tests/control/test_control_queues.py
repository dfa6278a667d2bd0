"""Typed PUSH/PULL queues on loopback: order kept, wrong types refused on both ends."""

from __future__ import annotations

import asyncio
import random

import pytest
import zmq
import zmq.asyncio

from pd_ssm.control.codec import CodecError
from pd_ssm.control.messages import TO_ROUTER, TO_WORKER, AbortRequest, HealthCheck, LoadReport
from pd_ssm.control.queues import AsyncPullQueue, PullQueue, PushQueue


def test_sync_queue_keeps_order_and_types() -> None:
    ctx = zmq.Context()
    pull = PullQueue(ctx, "127.0.0.1", TO_WORKER)
    push = PushQueue(ctx, pull.address, TO_WORKER)
    try:
        sent = [HealthCheck(random.randrange(1 << 30)) if random.random() < 0.5 else AbortRequest(f"r{i}")
                for i in range(random.randint(5, 40))]
        for m in sent:
            push.send(m)
        got = []
        while len(got) < len(sent):
            assert pull.poll(2000), "message lost"
            got.append(pull.recv_nowait())
        assert got == sent
        assert pull.recv_nowait() is None
        with pytest.raises(TypeError, match="cannot go on a queue"):
            push.send(LoadReport("w", 0, 0, 0, 0, 0, 0, 0, True))
        # a peer that sends the other direction's message: refused on receipt
        stray = PushQueue(ctx, pull.address, TO_ROUTER)
        stray.send(LoadReport("w", 0, 0, 0, 0, 0, 0, 0, True))
        assert pull.poll(2000)
        with pytest.raises(CodecError, match="unexpected LoadReport"):
            pull.recv_nowait()
        stray.close()
    finally:
        push.close()
        pull.close()
        ctx.destroy(linger=0)


def test_async_pull_receives_from_many_pushers() -> None:
    async def main() -> list[int]:
        actx, sctx = zmq.asyncio.Context(), zmq.Context()
        pull = AsyncPullQueue(actx, "127.0.0.1", TO_WORKER)
        pushers = [PushQueue(sctx, pull.address, TO_WORKER) for _ in range(3)]
        try:
            n = random.randint(3, 20)
            for i in range(n):
                pushers[i % 3].send(HealthCheck(i), block=False)
            got = [(await asyncio.wait_for(pull.recv(), 5)).seq for _ in range(n)]
        finally:
            for p in pushers:
                p.close()
            pull.close()
            actx.destroy(linger=0)
            sctx.destroy(linger=0)
        return got

    got = asyncio.run(main())
    assert sorted(got) == list(range(len(got)))
