"""DisaggDispatcher: pair a prefill and a decode worker for each request (DESIGN.md steps 1-2).

`submit` picks a prefill worker P (the routing policy over prefill workers) and sends it the
request at once -- P computes while a decode worker reserves room -- and asks a decode worker D
for a reservation (the same policy over decode workers).  D's ticket is forwarded to P, whose
pages may leave only then.  A refusal (D full: back-pressure) tries the next decode worker not
tried yet; when every one refused, the request waits here and is offered again to a decode worker
whose load report shows a free state slot.  Never more than one Reserve per request is out, so a
request never holds two reservations.

Ends: a failed transfer (TransferReport not ok, from either side) or a lost worker fails the
request with a 503 and the pool tells the other side to drop it; a ticket that comes for a
request already gone (client left, P lost) is given back at once.  Tokens, aborts and metrics of
the request are the colocated Dispatcher's: only the submission differs.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pd_ssm.control.disagg_messages import (
    ForwardTicket,
    PrefillRequest,
    ReserveReply,
    ReserveRequest,
    TransferReport,
)
from pd_ssm.control.messages import AbortRequest, LoadReport
from pd_ssm.router.dispatch import Dispatcher, Submitted
from pd_ssm.router.errors import APIError
from pd_ssm.router.metrics import RouterMetrics
from pd_ssm.router.policies import RoutingPolicy
from pd_ssm.router.workers import NoWorkerError, WorkerHandle, WorkerPool
from pd_ssm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pairing:
    """A request between its submission and its ticket."""

    req_id: str
    prefill_id: str
    num_tokens: int
    tried: set[str] = field(default_factory=set)  # decode workers that refused it since it last waited
    asked: str | None = None  # the decode worker whose answer is awaited


class DisaggDispatcher(Dispatcher):
    def __init__(self, pool: WorkerPool, policy: RoutingPolicy, metrics: RouterMetrics,
                 decode_policy: RoutingPolicy) -> None:
        super().__init__(pool, policy, metrics)
        self.decode_policy = decode_policy
        self.pairing: dict[str, _Pairing] = {}  # requests without a ticket yet
        self.waiting: deque[str] = deque()  # refused by every decode worker: offered again on free slots
        pool.listeners.append(self)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, prefix: str = "cmpl") -> Submitted:
        prefills = [w.view() for w in self.pool.in_rotation("prefill")]
        if not prefills or not self.pool.in_rotation("decode"):
            raise APIError(503, "no prefill or no decode worker is available right now; retry shortly "
                                "(see GET /health)")
        p = self.policy.choose(prefills).worker_id
        req_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            stream = self.pool.open(p, req_id, PrefillRequest(req_id, prompt_token_ids, params), first_from=p)
        except NoWorkerError as e:
            raise APIError(503, f"could not reach a prefill worker: {e}") from e
        n = len(prompt_token_ids)
        # NOTE: room for everything the request may generate, so a running request never needs a
        # page the worker cannot give (the worker caps it at its model length)
        self.pairing[req_id] = _Pairing(req_id, p, n + (params.max_tokens or 1))
        self._ask_next(req_id)
        log.debug("%s -> prefill %s", req_id, p)
        return Submitted(stream, n, time.monotonic())

    def _ask_next(self, req_id: str) -> None:
        """Ask a decode worker that has not refused it yet; none left: the request waits."""
        pr = self.pairing[req_id]
        if req_id not in self.pool.streams:  # ended meanwhile (client gone, worker lost)
            del self.pairing[req_id]
            return
        views = [w.view() for w in self.pool.in_rotation("decode") if w.worker_id not in pr.tried]
        if not views:
            pr.asked, pr.tried = None, set()
            self.waiting.append(req_id)
            return
        d = self.decode_policy.choose(views).worker_id
        pr.asked = d
        pr.tried.add(d)
        if not self.pool.command(d, ReserveRequest(req_id, pr.prefill_id, pr.num_tokens)):
            self._ask_next(req_id)

    # --- PoolListener ----------------------------------------------------------------------------
    def on_message(self, w: WorkerHandle, msg: Any) -> None:
        if isinstance(msg, ReserveReply):
            self._reply(w, msg)
        elif isinstance(msg, TransferReport):
            self._transfer(w, msg)
        elif isinstance(msg, LoadReport) and w.role == "decode" and msg.free_slots > 0:
            self._offer(w, msg.free_slots)

    def on_dead(self, w: WorkerHandle) -> None:
        # answers that will never come from it: ask another decode worker
        for pr in list(self.pairing.values()):
            if pr.asked == w.worker_id:
                self._ask_next(pr.req_id)

    def _reply(self, w: WorkerHandle, msg: ReserveReply) -> None:
        pr = self.pairing.get(msg.req_id)
        if pr is None or pr.asked != w.worker_id:
            if msg.ticket is not None:  # the request is gone: give the place back
                self.pool.command(w.worker_id, AbortRequest(msg.req_id))
            return
        if msg.ticket is None:
            log.debug("%s refused by %s: %s", msg.req_id, w.worker_id, msg.reason)
            self.metrics.reservations_refused.labels(w.worker_id).inc()
            self._ask_next(msg.req_id)
            return
        del self.pairing[msg.req_id]
        if not self.pool.attach(msg.req_id, w.worker_id) or not self.pool.command(
                pr.prefill_id, ForwardTicket(msg.ticket, w.worker_id)):
            self.pool.command(w.worker_id, AbortRequest(msg.req_id))
            self.pool.fail(msg.req_id, f"prefill worker {pr.prefill_id} does not take commands")

    def _offer(self, w: WorkerHandle, free_slots: int) -> None:
        """Waiting requests, oldest first, to a decode worker that reports free slots."""
        for _ in range(min(free_slots, len(self.waiting))):
            req_id = self.waiting.popleft()
            pr = self.pairing.get(req_id)
            if pr is None or req_id not in self.pool.streams:
                self.pairing.pop(req_id, None)  # ended while it waited
                continue
            pr.asked = w.worker_id
            pr.tried.add(w.worker_id)
            if not self.pool.command(w.worker_id, ReserveRequest(req_id, pr.prefill_id, pr.num_tokens)):
                self._ask_next(req_id)

    def _transfer(self, w: WorkerHandle, msg: TransferReport) -> None:
        if not msg.ok:
            self.metrics.transfers.labels(msg.role, "failed").inc()
            self.pool.fail(msg.req_id, f"state transfer failed on {msg.role} worker {w.worker_id}: {msg.error}")
            return
        self.metrics.observe_transfer(msg.worker_id, msg.role, msg.nbytes, msg.seconds)
        if msg.role == "prefill":
            self.pool.detach(msg.req_id, w.worker_id)  # its pages have left: losing P no longer matters

    def forget_ended(self) -> None:
        """Drop pairing state of requests that ended before their ticket (called on abort)."""
        for req_id in [r for r in self.pairing if r not in self.pool.streams]:
            pr = self.pairing.pop(req_id)
            if pr.asked is None and req_id in self.waiting:
                self.waiting.remove(req_id)

    def abort(self, sub: Submitted) -> None:
        super().abort(sub)
        self.forget_ended()


