"""WorkerPool: the router's typed ZMQ client to its workers, and their health.

One PULL socket (bound; its address is what workers are told) takes every worker's messages;
one PUSH per worker (connected to the address in its WorkerHello) carries commands.  A receive
task dispatches by message type: StepOutputs -> the per-request stream queues, LoadReport ->
the worker's load, WorkerError -> the failed request or (fatal) every request on that worker.

Health: every `health_interval` s each live worker gets a HealthCheck; a worker from which nothing
arrived for `health_timeout` s leaves rotation (UNRESPONSIVE) and comes back (HEALTHY) with its
next message.  A worker is DEAD when it says so (fatal WorkerError) or when whoever supervises
its process calls `mark_dead`; its in-flight requests then fail with a 503 at once, and a new
WorkerHello under the same id (a restarted process) brings it back.

Disaggregated requests run on two workers (streams.py: which workers hold a part of a request,
and the order of their deltas).  A stream that ends -- finished, failed, aborted -- sends
AbortRequest to every worker still holding a part (a no-op where it is gone), so neither side
keeps pages of a request the other side lost.  Messages of the disaggregated path (ReserveReply,
TransferReport) and deaths go to `listeners` (router/pairing.py).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
import zmq.asyncio

from pd_ssm.control.codec import CodecError
from pd_ssm.control.messages import (
    TO_ROUTER,
    TO_WORKER,
    AbortRequest,
    HealthCheck,
    LoadReport,
    Shutdown,
    StepOutputs,
    SubmitRequest,
    TokenDelta,
    WorkerError,
    WorkerHello,
)
from pd_ssm.control.queues import AsyncPullQueue, PushQueue
from pd_ssm.router.policies import WorkerView
from pd_ssm.router.streams import RequestStream, StreamFailure
from pd_ssm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class WorkerStatus(enum.Enum):
    STARTING = "starting"  # launched, no hello yet
    HEALTHY = "healthy"
    UNRESPONSIVE = "unresponsive"  # out of rotation until it answers again
    DEAD = "dead"


class PoolListener(Protocol):
    """Told of what the pool does not handle itself (the disaggregated dispatcher)."""

    def on_message(self, w: WorkerHandle, msg: Any) -> None: ...

    def on_dead(self, w: WorkerHandle) -> None: ...


@dataclass(slots=True)
class WorkerHandle:
    worker_id: str
    status: WorkerStatus = WorkerStatus.STARTING
    role: str = ""  # from its hello: "colocated" | "prefill" | "decode"
    address: str = ""
    pid: int | None = None
    max_model_len: int = 0
    last_seen: float = 0.0  # monotonic seconds of the last message from it
    load: LoadReport | None = None
    error: str | None = None
    inflight: set[str] = field(default_factory=set)
    push: PushQueue | None = None

    def view(self) -> WorkerView:
        r = self.load
        if r is None:
            return WorkerView(self.worker_id, inflight=len(self.inflight))
        return WorkerView(self.worker_id, len(self.inflight), r.running, r.waiting, r.free_slots, r.free_blocks)


class NoWorkerError(RuntimeError):
    """No worker is in rotation (HTTP 503)."""


class WorkerPool:
    def __init__(
        self, host: str, expected: Iterable[str] = (), health_interval: float = 0.5, health_timeout: float = 3.0
    ) -> None:
        if not 0 < health_interval < health_timeout:
            raise ValueError(f"need 0 < health_interval ({health_interval}) < health_timeout ({health_timeout})")
        self.host = host
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.workers: dict[str, WorkerHandle] = {w: WorkerHandle(w) for w in expected}
        self.streams: dict[str, RequestStream] = {}
        self._actx = zmq.asyncio.Context()
        self._sctx = zmq.Context()
        self.pull = AsyncPullQueue(self._actx, host, TO_ROUTER)
        self.listeners: list[PoolListener] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = 0

    @property
    def address(self) -> str:
        """Where workers send their messages (give it to them at launch)."""
        return self.pull.address

    def start(self) -> None:
        """Start the receive and health tasks on the running event loop."""
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._health_loop())]

    async def close(self, shutdown_workers: bool = False) -> None:
        for w in self.workers.values():
            if shutdown_workers and w.push is not None and w.status is not WorkerStatus.DEAD:
                self._send(w, Shutdown("router closing"))
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self.workers.values():
            if w.push is not None:
                w.push.close()
                w.push = None
        self.pull.close()
        # destroy, not term: term waits for every socket, and one left open would hang shutdown
        self._actx.destroy(linger=0)
        self._sctx.destroy(linger=0)

    # --- rotation --------------------------------------------------------------------------
    def in_rotation(self, role: str | None = None) -> list[WorkerHandle]:
        """Healthy workers (of `role`, when given)."""
        return [w for w in self.workers.values()
                if w.status is WorkerStatus.HEALTHY and (role is None or w.role == role)]

    def max_model_len(self) -> int:
        """The longest request every worker in rotation can hold (0 with none)."""
        return min((w.max_model_len for w in self.in_rotation()), default=0)

    # --- requests --------------------------------------------------------------------------
    def submit(self, worker_id: str, req_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        return self.open(worker_id, req_id, SubmitRequest(req_id, prompt_token_ids, params))

    def open(self, worker_id: str, req_id: str, command: Any, first_from: str | None = None) -> RequestStream:
        """Start a request on `worker_id` with `command`; its stream takes that worker's deltas."""
        w = self.workers[worker_id]
        if w.status is not WorkerStatus.HEALTHY or w.push is None:
            raise NoWorkerError(f"worker {worker_id} is {w.status.value}")
        if req_id in self.streams:
            raise ValueError(f"request id {req_id!r} is already live")
        stream = RequestStream(req_id, worker_id, first_from=first_from)
        self.streams[req_id] = stream
        w.inflight.add(req_id)
        if not self._send(w, command):
            self._end(stream)
            raise NoWorkerError(f"worker {worker_id} does not take commands (its queue is full)")
        return stream

    def attach(self, req_id: str, worker_id: str) -> bool:
        """`worker_id` now holds a part of the request (its deltas count); False if the request is gone."""
        stream, w = self.streams.get(req_id), self.workers.get(worker_id)
        if stream is None or w is None or w.status is WorkerStatus.DEAD:
            return False
        stream.workers.add(worker_id)
        w.inflight.add(req_id)
        return True

    def detach(self, req_id: str, worker_id: str) -> None:
        """`worker_id` holds nothing of the request any more (its pages left): losing it no longer fails it."""
        stream = self.streams.get(req_id)
        if stream is not None and stream.first_from is None:
            stream.workers.discard(worker_id)
        w = self.workers.get(worker_id)
        if w is not None and (stream is None or worker_id not in stream.workers):
            w.inflight.discard(req_id)

    def command(self, worker_id: str, msg: Any) -> bool:
        """Send a command to a live worker; False if it cannot take it."""
        w = self.workers.get(worker_id)
        return w is not None and w.status is not WorkerStatus.DEAD and self._send(w, msg)

    def abort(self, req_id: str) -> None:
        """Tell its workers to drop the request and free its pages; no-op once it has finished."""
        stream = self.streams.get(req_id)
        if stream is not None:
            self._end(stream)

    def fail(self, req_id: str, message: str) -> None:
        """End a request with a 503 (`message`); its workers are told to drop it."""
        stream = self.streams.get(req_id)
        if stream is not None:
            stream.queue.put_nowait(StreamFailure(message))
            self._end(stream)

    def _end(self, stream: RequestStream, finished_on: str | None = None) -> None:
        """The stream is over: every worker still holding a part of it (but the one it finished
        on, which released it itself) is told to drop it."""
        stream.done = True
        self.streams.pop(stream.req_id, None)
        for worker_id in stream.workers:
            w = self.workers.get(worker_id)
            if w is None:
                continue
            w.inflight.discard(stream.req_id)
            if worker_id != finished_on and w.status is not WorkerStatus.DEAD:
                self._send(w, AbortRequest(stream.req_id))

    def mark_dead(self, worker_id: str, reason: str) -> None:
        """The worker is gone (process exited, fatal error): fail its requests, drop it from rotation."""
        w = self.workers.setdefault(worker_id, WorkerHandle(worker_id))
        if w.status is WorkerStatus.DEAD:
            return
        log.error("worker %s is dead: %s", worker_id, reason)
        w.status, w.error = WorkerStatus.DEAD, reason
        self._fail_inflight(w, f"worker {worker_id} failed: {reason}")
        if w.push is not None:
            w.push.close()
            w.push = None
        for listener in self.listeners:
            listener.on_dead(w)

    def _fail_inflight(self, w: WorkerHandle, message: str) -> None:
        for req_id in list(w.inflight):
            self.fail(req_id, message)
        w.inflight.clear()

    # --- receiving -------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            try:
                msg = await self.pull.recv()
            except CodecError as e:  # a peer that speaks something else: drop it, keep serving
                log.warning("dropped a control message: %s", e)
                continue
            self._dispatch(msg)

    def _dispatch(self, msg: Any) -> None:
        w = self.workers.get(msg.worker_id)
        if isinstance(msg, WorkerHello):
            w = self._hello(msg)
        elif w is None or w.status is WorkerStatus.DEAD:
            return  # a late message from a worker already given up on
        w.last_seen = time.monotonic()
        if isinstance(msg, StepOutputs):
            for delta in msg.deltas:
                stream = self.streams.get(delta.req_id)
                if stream is not None and w.worker_id in stream.workers:
                    self._deliver(stream, w.worker_id, delta)
        elif isinstance(msg, LoadReport):
            w.load = msg
        elif isinstance(msg, WorkerError):
            if msg.fatal:
                self.mark_dead(w.worker_id, msg.message)
                return
            log.warning("worker %s: %s", w.worker_id, msg.message)
            if msg.req_id is not None:
                self.fail(msg.req_id, f"worker {w.worker_id}: {msg.message}")
        for listener in self.listeners:
            listener.on_message(w, msg)
        if w.status in (WorkerStatus.UNRESPONSIVE, WorkerStatus.STARTING) and w.push is not None:
            log.info("worker %s is in rotation", w.worker_id)
            w.status = WorkerStatus.HEALTHY

    def _deliver(self, stream: RequestStream, worker_id: str, delta: TokenDelta) -> None:
        for d in stream.accept(worker_id, delta):
            stream.queue.put_nowait(d)
            if d.finished:
                self._end(stream, finished_on=worker_id if d is delta else None)
                return

    def _hello(self, msg: WorkerHello) -> WorkerHandle:
        w = self.workers.setdefault(msg.worker_id, WorkerHandle(msg.worker_id))
        # a hello from a known worker is a new process under the old id: what the old one ran is lost
        self._fail_inflight(w, f"worker {msg.worker_id} restarted (pid {msg.pid}); its requests were lost")
        if w.push is not None:
            w.push.close()
        w.address, w.pid, w.max_model_len, w.error = msg.address, msg.pid, msg.max_model_len, None
        w.role = msg.role
        w.push = PushQueue(self._sctx, msg.address, TO_WORKER)
        w.status = WorkerStatus.STARTING  # HEALTHY right below, in _dispatch
        log.info("worker %s (pid %d) at %s, max_model_len %d", msg.worker_id, msg.pid, msg.address,
                 msg.max_model_len)
        return w

    # --- health ----------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            self.check_health(time.monotonic())

    def check_health(self, now: float) -> None:
        self._seq += 1
        for w in self.workers.values():
            if w.push is None or w.status is WorkerStatus.DEAD:
                continue
            if w.status is WorkerStatus.HEALTHY and now - w.last_seen > self.health_timeout:
                log.warning("worker %s has not answered for %.1f s: out of rotation", w.worker_id, now - w.last_seen)
                w.status = WorkerStatus.UNRESPONSIVE
            self._send(w, HealthCheck(self._seq))

    def _send(self, w: WorkerHandle, msg: Any) -> bool:
        if w.push is None:
            return False
        try:
            w.push.send(msg, block=False)
        except zmq.Again:
            return False
        return True
