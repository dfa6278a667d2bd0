"""WorkerPool against scripted worker peers (real ZMQ on loopback, no engine): rotation by health,
deltas routed to their request, restarts and garbage handled without hurting other workers."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import zmq

from pd_ssm.control.messages import (
    TO_ROUTER,
    TO_WORKER,
    HealthCheck,
    LoadReport,
    StepOutputs,
    SubmitRequest,
    TokenDelta,
    WorkerHello,
)
from pd_ssm.control.queues import PullQueue, PushQueue
from pd_ssm.router.workers import StreamFailure, WorkerPool, WorkerStatus
from pd_ssm.sampling_params import SamplingParams


class FakeWorker:
    """Says hello, then (while `answering`) answers health checks; records every command. No engine."""

    def __init__(self, ctx: zmq.Context, worker_id: str, router: str, pid: int) -> None:
        self.id = worker_id
        self.answering = True
        self.seen: list[Any] = []
        self.commands = PullQueue(ctx, "127.0.0.1", TO_WORKER)
        self.out = PushQueue(ctx, router, TO_ROUTER)
        self.out.send(WorkerHello(worker_id, self.commands.address, pid, "m", 128))

    def pump(self) -> None:
        while (m := self.commands.recv_nowait()) is not None:
            self.seen.append(m)
            if isinstance(m, HealthCheck) and self.answering:
                self.out.send(LoadReport(self.id, m.seq, 0, 0, 4, 0, 8, 0, True))

    def close(self) -> None:
        self.commands.close()
        self.out.close()


async def _until(pred: Any, within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_pool_routes_deltas_tracks_health_and_handles_restarts() -> None:
    ctx = zmq.Context()

    async def main() -> None:
        pool = WorkerPool("127.0.0.1", expected=["a", "b"], health_interval=0.05, health_timeout=0.3)
        pool.start()
        fakes = {"a": FakeWorker(ctx, "a", pool.address, 11), "b": FakeWorker(ctx, "b", pool.address, 12)}

        async def pump() -> None:
            while True:
                for f in list(fakes.values()):
                    f.pump()
                await asyncio.sleep(0.01)

        pumping = asyncio.create_task(pump())
        a, b = fakes["a"], fakes["b"]
        try:
            await _until(lambda: len(pool.in_rotation()) == 2)
            prompt = [random.randrange(500) for _ in range(random.randint(1, 30))]
            stream = pool.submit("a", "r1", prompt, SamplingParams(max_tokens=4))
            await _until(lambda: any(isinstance(m, SubmitRequest) and m.prompt_token_ids == prompt for m in a.seen))
            toks = [random.randrange(500) for _ in range(4)]
            # a delta from the wrong worker, or for an unknown request, is ignored
            b.out.send(StepOutputs("b", [TokenDelta("r1", [1], "x", len(prompt), 1)]))
            a.out.send(StepOutputs("a", [TokenDelta("nope", [1], "x", 1, 1)]))
            for i, t in enumerate(toks):
                done = "length" if i == len(toks) - 1 else None
                a.out.send(StepOutputs("a", [TokenDelta("r1", [t], str(t), len(prompt), i + 1, done)]))
            got = [await asyncio.wait_for(stream.queue.get(), 3) for _ in toks]
            assert [d.token_ids[0] for d in got] == toks and got[-1].finished
            assert stream.done and not pool.workers["a"].inflight and "r1" not in pool.streams

            # garbage on the router's socket is dropped; the pool keeps working
            raw = ctx.socket(zmq.PUSH)
            raw.connect(pool.address)
            raw.send(random.randbytes(32))
            raw.close(linger=1000)

            # b goes silent: out of rotation after the timeout; answers again: back in
            b.answering = False
            await _until(lambda: pool.workers["b"].status is WorkerStatus.UNRESPONSIVE)
            assert [w.worker_id for w in pool.in_rotation()] == ["a"]
            b.answering = True
            await _until(lambda: pool.workers["b"].status is WorkerStatus.HEALTHY)
            assert pool.workers["b"].load is not None and pool.workers["b"].load.free_slots == 4

            # b restarts (a new hello under its id): its in-flight request fails, b stays usable
            lost = pool.submit("b", "r2", prompt, SamplingParams())
            b.close()
            b = fakes["b"] = FakeWorker(ctx, "b", pool.address, 99)
            item = await asyncio.wait_for(lost.queue.get(), 3)
            assert isinstance(item, StreamFailure) and "restarted" in item.message
            await _until(lambda: pool.workers["b"].status is WorkerStatus.HEALTHY)
            assert pool.workers["b"].pid == 99
            pool.mark_dead("b", "gone")
            assert pool.workers["b"].status is WorkerStatus.DEAD
            assert [w.worker_id for w in pool.in_rotation()] == ["a"]
        finally:
            pumping.cancel()
            for f in fakes.values():
                f.close()
            await pool.close()

    try:
        asyncio.run(main())
    finally:
        ctx.destroy(linger=0)
