"""DecodeRole: reserve room for a request's pages, receive and import them, decode in the batch
(DESIGN.md steps 2, 4, 5).

Reserve: `Engine.reserve` holds a state slot and the KV blocks first -- a full pool refuses
(ReserveReply without a ticket: back-pressure, the router tries another worker or waits), never
over-commits -- then the ReservationTable issues the ticket the router forwards to the prefill
worker.  Pages that arrive and check out are imported into exactly that place and the request
joins the running batch; its tokens leave through the worker loop's StepOutputs.

Every reservation ends in exactly one of: imported, aborted (AbortRequest), released because the
sender aborted it (the connector's `get_failures`, kind SENDER_ABORTED), failed (any other kind:
bad frame, sender gone) or expired (nothing came before the ticket's expiry).  All but the first
give the slot and blocks back (`Engine.cancel_reservation`); failures and expiries are reported to
the router, which ends the request.  A sender's abort is not: the prefill worker reports its own
aborts (a request that ended at its first token, a send that failed there), and a report from here
could reach the router before that request's last token and fail it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pd_ssm.cache.manager import CacheFullError
from pd_ssm.cache.pages import StatePages
from pd_ssm.control.disagg_messages import ReserveReply, ReserveRequest, TicketSpec, TransferReport
from pd_ssm.control.messages import AbortRequest, StepOutputs, SubmitRequest, TokenDelta
from pd_ssm.decode_worker.receivers import Receivers
from pd_ssm.engine.engine import Engine, RequestError
from pd_ssm.outputs import RequestOutput
from pd_ssm.state_transfer.base import Connector, FailureKind, TransferStats
from pd_ssm.worker.engine_worker import delta_from_output

log = logging.getLogger(__name__)


class DecodeRole:
    name = "decode"

    def __init__(self, engine: Engine, receivers: Receivers, worker_id: str) -> None:
        self.engine = engine
        self.receivers = receivers
        self.table = receivers.table
        self.worker_id = worker_id
        self._owner: dict[str, Connector] = {}  # reserved request -> the receiver its pages come through
        self._send: Callable[[Any], None] = _unstarted

    def start(self, send: Callable[[Any], None]) -> None:
        self._send = send

    def handle(self, msg: Any) -> bool:
        if isinstance(msg, ReserveRequest):
            self._reserve(msg)
        elif isinstance(msg, AbortRequest):
            if msg.req_id not in self.engine.reserved:
                return False  # running (or unknown): the loop aborts it in the engine
            self._release(msg.req_id)
        elif isinstance(msg, SubmitRequest):
            delta = TokenDelta(msg.req_id, [], "", len(msg.prompt_token_ids), 0, finish_reason="error",
                               error="this is a decode worker: send ReserveRequest, then pages")
            self._send(StepOutputs(self.worker_id, [delta]))
        else:
            return False
        return True

    def _reserve(self, msg: ReserveRequest) -> None:
        rx = self.receivers.for_prefill(msg.prefill_id)
        # NOTE: capped at the model length: a request cannot grow past it, so this never refuses one
        # that would fit an empty worker
        num_tokens = min(msg.num_tokens, self.engine.max_model_len)
        try:
            slot, blocks = self.engine.reserve(msg.req_id, num_tokens)
        except (CacheFullError, RequestError) as e:
            self._send(ReserveReply(self.worker_id, msg.req_id, None, str(e)))
            return
        t = self.table.reserve(msg.req_id, rx.address, slot, blocks)
        self._owner[msg.req_id] = rx.connector
        spec = TicketSpec(t.req_id, t.address, t.slot, list(t.block_ids), t.expiry, t.token, rx.rendezvous)
        self._send(ReserveReply(self.worker_id, msg.req_id, spec))

    def _release(self, req_id: str) -> None:
        """Give back a reservation whose pages will not be imported (idempotent)."""
        connector = self._owner.pop(req_id, None)
        if connector is not None:
            connector.abort(req_id)  # drops what arrived of it and its late pieces
        self.table.cancel(req_id)
        self.engine.cancel_reservation(req_id)

    # --- transfers -----------------------------------------------------------------------------
    def progress(self) -> bool:
        changed = False
        for connector in self.receivers.all():
            arrived: list[StatePages] = []
            while (pages := connector.poll()) is not None:
                arrived.append(pages)
            take_stats = getattr(connector, "get_stats", None)
            stats: dict[str, TransferStats] = take_stats() if take_stats is not None else {}
            for pages in arrived:
                changed |= self._import(pages, stats.get(pages.req_id))
            for req_id, failure in connector.get_failures().items():
                if req_id in self.engine.reserved:
                    if failure.kind is FailureKind.SENDER_ABORTED:
                        log.debug("decode worker %s: %s released: %s", self.worker_id, req_id, failure.reason)
                        self._release(req_id)  # NOTE: no report: the sender reports its aborts itself
                    else:
                        self._fail(req_id, failure.reason)
                    changed = True
                elif req_id.startswith("!"):
                    log.warning("decode worker %s: dropped a transfer: %s", self.worker_id, failure.reason)
        for ticket in self.table.expire():
            self._fail(ticket.req_id, f"no pages came within the reservation's {self.table.ttl} s")
            changed = True
        return changed

    def _import(self, pages: StatePages, st: TransferStats | None) -> bool:
        req_id = pages.req_id
        self._owner.pop(req_id, None)
        try:
            self.engine.import_reserved(pages)  # frees the reservation itself on failure
        except Exception as e:  # a request that cannot run here fails alone; the worker keeps serving
            self._fail(req_id, f"import failed: {type(e).__name__}: {e}")
            return True
        self._send(TransferReport(self.worker_id, req_id, self.name, True,
                                  st.nbytes if st else pages.nbytes(), st.seconds if st else 0.0))
        return False

    def _fail(self, req_id: str, why: str) -> None:
        log.warning("decode worker %s: %s failed: %s", self.worker_id, req_id, why)
        self._release(req_id)
        self._send(TransferReport(self.worker_id, req_id, self.name, False, error=why))

    def pending(self) -> bool:
        return bool(self.engine.reserved)

    @property
    def reserved(self) -> int:
        return len(self.engine.reserved)

    @property
    def transfers(self) -> int:
        return len(self.engine.reserved)

    @property
    def queued(self) -> int:
        return 0  # a reservation is answered at once: nothing waits outside the engine

    def delta(self, out: RequestOutput) -> TokenDelta:
        return delta_from_output(out)

    def close(self) -> None:
        self.receivers.close()


def _unstarted(msg: Any) -> None:
    raise RuntimeError("DecodeRole.start was not called: the worker loop gives the role its router queue")
