"""DisaggDispatcher against scripted prefill / decode peers (real ZMQ on loopback, no engine).

Refusals go to the next decode worker, then wait for a load report with a free slot (never two
Reserves out for one request); the ticket goes to the prefill worker; the decode worker's tokens
that overtake the prefill worker's first token wait for it; a ticket for a request that is gone is
given back; a decode worker lost with a Reserve outstanding hands the request to another; a failed
transfer ends the request with a 503 and tells the other side.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import zmq

from pd_ssm.control.disagg_messages import (
    ForwardTicket,
    PrefillRequest,
    ReserveReply,
    ReserveRequest,
    TicketSpec,
    TransferReport,
)
from pd_ssm.control.messages import (
    TO_ROUTER,
    TO_WORKER,
    AbortRequest,
    HealthCheck,
    LoadReport,
    StepOutputs,
    TokenDelta,
    WorkerHello,
)
from pd_ssm.control.queues import PullQueue, PushQueue
from pd_ssm.router.metrics import RouterMetrics
from pd_ssm.router.pairing import DisaggDispatcher
from pd_ssm.router.policies import LeastLoaded
from pd_ssm.router.workers import StreamFailure, WorkerPool
from pd_ssm.sampling_params import SamplingParams


class Peer:
    """A scripted worker of one role: answers health checks with no free slot, records commands."""

    def __init__(self, ctx: zmq.Context, worker_id: str, role: str, router: str) -> None:
        self.id = worker_id
        self.seen: list[Any] = []
        self.commands = PullQueue(ctx, "127.0.0.1", TO_WORKER)
        self.out = PushQueue(ctx, router, TO_ROUTER)
        self.out.send(WorkerHello(worker_id, self.commands.address, random.randrange(1, 1 << 20), "m", 512, role))

    def pump(self) -> None:
        while (m := self.commands.recv_nowait()) is not None:
            if isinstance(m, HealthCheck):
                self.out.send(LoadReport(self.id, m.seq, 0, 0, 0, 4, 0, 8, True))
            else:
                self.seen.append(m)

    def of(self, kind: type) -> list[Any]:
        return [m for m in self.seen if isinstance(m, kind)]

    def close(self) -> None:
        self.commands.close()
        self.out.close()


async def _until(pred: Any, within: float = 10.0) -> None:  # generous: CI hosts are loaded
    deadline = time.monotonic() + within
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _spec(req_id: str, slot: int) -> TicketSpec:
    return TicketSpec(req_id, "tcp://127.0.0.1:1", slot, [random.randrange(64)], time.monotonic() + 30, "t")


def _delta(req_id: str, tokens: list[int], total: int, finish: str | None = None) -> TokenDelta:
    return TokenDelta(req_id, tokens, "", 3, total, finish_reason=finish)


def test_pairing_backpressure_ordering_and_failures() -> None:
    ctx = zmq.Context()
    rng = random.Random()

    async def main() -> None:
        pool = WorkerPool("127.0.0.1", expected=["p0", "d0", "d1"], health_interval=0.05, health_timeout=2.0)
        pool.start()
        disp = DisaggDispatcher(pool, LeastLoaded(), RouterMetrics(pool), LeastLoaded())
        peers = {w: Peer(ctx, w, "prefill" if w[0] == "p" else "decode", pool.address) for w in ("p0", "d0", "d1")}
        p0, d0, d1 = peers["p0"], peers["d0"], peers["d1"]

        async def pump() -> None:
            while True:
                for p in peers.values():
                    p.pump()
                await asyncio.sleep(0.005)

        pumper = asyncio.create_task(pump())
        try:
            await _until(lambda: len(pool.in_rotation("decode")) == 2 and len(pool.in_rotation("prefill")) == 1)
            prompt = [rng.randrange(100) for _ in range(3)]
            n = rng.randint(4, 50)
            sub = disp.submit(prompt, SamplingParams(max_tokens=n))
            rid = sub.stream.req_id
            await _until(lambda: p0.of(PrefillRequest) and (d0.of(ReserveRequest) or d1.of(ReserveRequest)))
            assert p0.of(PrefillRequest)[0].prompt_token_ids == prompt
            first, second = (d0, d1) if d0.of(ReserveRequest) else (d1, d0)
            assert first.of(ReserveRequest)[0] == ReserveRequest(rid, "p0", 3 + n)
            # both refuse: exactly one Reserve each, then the request waits
            first.out.send(ReserveReply(first.id, rid, None, "full"))
            await _until(lambda: second.of(ReserveRequest))
            second.out.send(ReserveReply(second.id, rid, None, "full"))
            await _until(lambda: list(disp.waiting) == [rid])
            assert len(first.of(ReserveRequest)) == len(second.of(ReserveRequest)) == 1
            assert b'pd_ssm_reservations_refused_total{worker="d0"} 1.0' in disp.metrics.render()
            # a slot frees on `second`: the waiting request is offered to it, which accepts
            second.out.send(LoadReport(second.id, -1, 0, 0, 1, 3, 8, 0, True))
            await _until(lambda: len(second.of(ReserveRequest)) == 2)
            spec = _spec(rid, rng.randrange(4))
            second.out.send(ReserveReply(second.id, rid, spec))
            await _until(lambda: p0.of(ForwardTicket))
            assert p0.of(ForwardTicket)[0] == ForwardTicket(spec, second.id)
            assert pool.streams[rid].workers == {"p0", second.id}
            # the decode worker's tokens overtake the prefill worker's first one: they wait for it
            second.out.send(StepOutputs(second.id, [_delta(rid, [7], 2)]))
            await asyncio.sleep(0.05)
            assert sub.stream.queue.empty()
            p0.out.send(StepOutputs("p0", [_delta(rid, [5], 1)]))
            p0.out.send(TransferReport("p0", rid, "prefill", True, 4096, 0.001))
            await _until(lambda: sub.stream.queue.qsize() == 2 and rid not in pool.workers["p0"].inflight)
            assert [sub.stream.queue.get_nowait().token_ids for _ in range(2)] == [[5], [7]]
            second.out.send(StepOutputs(second.id, [_delta(rid, [9], n, "length")]))
            await _until(lambda: sub.stream.done)
            assert not p0.of(AbortRequest) and not second.of(AbortRequest)  # it ended where it ran

            # a ticket that comes after the client left is given back
            sub2 = disp.submit(prompt, SamplingParams(max_tokens=2))
            rid2 = sub2.stream.req_id
            await _until(lambda: any(m.req_id == rid2 for d in (d0, d1) for m in d.of(ReserveRequest)))
            asked = next(d for d in (d0, d1) if any(m.req_id == rid2 for m in d.of(ReserveRequest)))
            disp.abort(sub2)
            asked.out.send(ReserveReply(asked.id, rid2, _spec(rid2, 0)))
            await _until(lambda: any(m.req_id == rid2 for m in asked.of(AbortRequest)))
            assert any(m.req_id == rid2 for m in p0.of(AbortRequest)) and rid2 not in disp.pairing

            # the decode worker asked dies before answering: the other one is asked
            sub3 = disp.submit(prompt, SamplingParams(max_tokens=2))
            rid3 = sub3.stream.req_id
            await _until(lambda: any(m.req_id == rid3 for d in (d0, d1) for m in d.of(ReserveRequest)))
            dead = next(d for d in (d0, d1) if any(m.req_id == rid3 for m in d.of(ReserveRequest)))
            alive = d1 if dead is d0 else d0
            pool.mark_dead(dead.id, "killed by the test")
            await _until(lambda: any(m.req_id == rid3 for m in alive.of(ReserveRequest)))
            alive.out.send(ReserveReply(alive.id, rid3, _spec(rid3, 1)))
            await _until(lambda: any(m.ticket.req_id == rid3 for m in p0.of(ForwardTicket)))
            # its transfer fails on the decode side: a 503 for the client, the prefill worker drops it
            alive.out.send(TransferReport(alive.id, rid3, "decode", False, error="bad frame"))
            await _until(lambda: sub3.stream.done)
            failure = sub3.stream.queue.get_nowait()
            assert isinstance(failure, StreamFailure) and "bad frame" in failure.message
            await _until(lambda: any(m.req_id == rid3 for m in p0.of(AbortRequest)))
            assert all(not w.inflight for w in pool.workers.values())
        finally:
            pumper.cancel()
            await pool.close()

    try:
        asyncio.run(main())
    finally:
        ctx.destroy(linger=0)
