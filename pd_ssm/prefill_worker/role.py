"""PrefillRole: the engine streams every finished prefill to a decode worker (DESIGN.md steps 2-3).

The engine runs in the prefill role (`Engine.stream_prefills_to`): a request's first token is a
step output like any other -- the worker loop sends it to the router at once (TTFT) -- and its
pages go layer by layer to this role (a PageSink), which passes them to a ConnectorSink.  The
ticket (ForwardTicket) may come before or after the prefill: the ConnectorSink holds what is
ready until it does.

A request is `live` here from its PrefillRequest until exactly one of: its transfer is sent
(TransferReport ok), it fails (TransferReport not ok: expired ticket, peer gone), it finishes at
its first token or is aborted (the sink's `cancel`).  The engine frees its pages as soon as they
are shipped; what stays is the connector's host copy, released by the same events.

Back-pressure: the router sends a request here at once and asks decode workers for room at the
same time; while every decode worker is full, its ticket does not come, and a finished prefill's
exported pages (168 MB for a Mamba2-2.7B request with fp32 state, on the GPU for NCCL) wait here.
So at most `max_unsent` live requests may lack a ticket: past that, a new PrefillRequest waits in
`deferred` (a few hundred bytes on the host) and enters the engine when a ticketless request
ships or ends.  A deferred request whose ticket comes enters at once: its pages can leave as soon
as they are made, and its reservation on the decode side would expire while it waited behind
requests that have none.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages
from pd_ssm.control.disagg_messages import ForwardTicket, PrefillRequest, TicketSpec, TransferReport
from pd_ssm.control.messages import AbortRequest, StepOutputs, SubmitRequest, TokenDelta
from pd_ssm.engine.engine import Engine, RequestError
from pd_ssm.outputs import RequestOutput
from pd_ssm.prefill_worker.fanout import FanoutConnector
from pd_ssm.state_transfer.base import Connector, Ticket
from pd_ssm.state_transfer.connector_sink import ConnectorSink
from pd_ssm.worker.engine_worker import delta_from_output

log = logging.getLogger(__name__)


def ticket_of(spec: TicketSpec) -> Ticket:
    return Ticket(spec.req_id, spec.address, spec.slot, list(spec.block_ids), spec.expiry, spec.token)


class PrefillRole:
    name = "prefill"

    def __init__(self, engine: Engine, connector: Connector, worker_id: str, max_unsent: int = 64) -> None:
        if max_unsent < 1:
            raise ValueError(f"max_unsent must be >= 1, got {max_unsent}")
        self.engine = engine
        self.connector = connector
        self.worker_id = worker_id
        self.max_unsent = max_unsent
        self.sink = ConnectorSink(connector)
        self.live: set[str] = set()  # in the engine or shipping: from admission to its end
        self.ticketed: set[str] = set()  # live or deferred requests whose ticket came
        self.deferred: OrderedDict[str, PrefillRequest] = OrderedDict()  # not in the engine yet, in arrival order
        self._send: Callable[[Any], None] = _unstarted
        # NOTE: a connector that sends whole requests (NCCL) gets them after the forward, which then
        # needs no per-layer hook and may run in a prefill CUDA graph
        engine.stream_prefills_to(self, per_layer=self.sink.streams)

    def start(self, send: Callable[[Any], None]) -> None:
        self._send = send

    # --- PageSink: the engine's exporter calls these ------------------------------------------
    @property
    def device_pages(self) -> bool:
        return self.sink.device_pages

    def send_layers(self, req_id: str, layers: list[LayerPages], ready: Any = None, last: bool = False) -> None:
        self.sink.send_layers(req_id, layers, ready, last)

    def finish(self, request: RequestState) -> None:
        self.sink.finish(request)

    def finish_pages(self, pages: StatePages) -> None:
        self.sink.finish_pages(pages)

    def cancel(self, req_id: str) -> None:
        # finished at its first token, or aborted: nothing will be sent for it
        self._end(req_id)
        self.sink.cancel(req_id)

    # --- commands ------------------------------------------------------------------------------
    def handle(self, msg: Any) -> bool:
        if isinstance(msg, PrefillRequest):
            if msg.req_id in self.deferred or msg.req_id in self.live:
                self._refuse(msg.req_id, len(msg.prompt_token_ids), f"request id {msg.req_id!r} is already here")
            else:
                self.deferred[msg.req_id] = msg
                self._admit()
        elif isinstance(msg, ForwardTicket):
            self._ticket(msg)
        elif isinstance(msg, AbortRequest):
            if self.engine.abort(msg.req_id) is None:  # not in the engine: maybe in the sink / connector
                self.cancel(msg.req_id)
        elif isinstance(msg, SubmitRequest):
            self._refuse(msg.req_id, len(msg.prompt_token_ids), "this is a prefill worker: send PrefillRequest")
        else:
            return False
        return True

    def _prefill(self, msg: PrefillRequest) -> None:
        try:
            self.engine.add_request(msg.prompt_token_ids, msg.params, request_id=msg.req_id)
        except RequestError as e:
            self._end(msg.req_id)
            self.sink.cancel(msg.req_id)  # a ticket that came while it was deferred
            self._refuse(msg.req_id, len(msg.prompt_token_ids), str(e))
            return
        self.live.add(msg.req_id)

    def _admit(self) -> bool:
        """Deferred requests into the engine, in order, while fewer than `max_unsent` live ones lack
        a ticket; one whose ticket came goes in regardless. Whether any went in."""
        room = self.max_unsent - len(self.live - self.ticketed)
        if room <= 0 and self.ticketed.isdisjoint(self.deferred):
            return False  # NOTE: the common case under back-pressure, once per loop turn: no scan
        admitted = False
        for req_id in list(self.deferred):
            if req_id not in self.ticketed:
                if room <= 0:
                    continue  # keeps its place in line
                room -= 1
            self._prefill(self.deferred.pop(req_id))
            admitted = True
        return admitted

    def _ticket(self, msg: ForwardTicket) -> None:
        spec = msg.ticket
        if spec.req_id not in self.live and spec.req_id not in self.deferred:
            return  # finished at its first token or aborted meanwhile; D's reservation is the router's to drop
        try:
            if isinstance(self.connector, FanoutConnector):
                self.connector.add_peer(spec.address, spec.rendezvous)
            self.sink.expect(ticket_of(spec))
        except (ValueError, RuntimeError) as e:  # no pairing with that decode worker, a second ticket
            self._fail(spec.req_id, f"cannot send to decode worker {msg.decode_id}: {e}")
            return
        self.ticketed.add(spec.req_id)
        if spec.req_id in self.deferred:
            self._admit()

    def _refuse(self, req_id: str, prompt_tokens: int, why: str) -> None:
        delta = TokenDelta(req_id, [], "", prompt_tokens, 0, finish_reason="error", error=why)
        self._send(StepOutputs(self.worker_id, [delta]))

    # --- transfers -----------------------------------------------------------------------------
    def progress(self) -> bool:
        sent, _ = self.connector.get_finished()
        failed = {**self.connector.get_failed(), **self.sink.take_failed()}
        take_stats = getattr(self.connector, "get_stats", None)
        stats = take_stats() if take_stats is not None else {}
        for req_id in sent:
            if req_id in self.live:
                self._end(req_id)
                st = stats.get(req_id)
                self._send(TransferReport(self.worker_id, req_id, self.name, True,
                                          st.nbytes if st else 0, st.seconds if st else 0.0))
        for req_id, why in failed.items():
            if req_id in self.live:
                self._fail(req_id, why)
            elif req_id.startswith("!"):
                log.warning("prefill worker %s: transfer failure: %s", self.worker_id, why)
        admitted = self._admit()
        return bool(sent or failed or admitted)

    def _end(self, req_id: str) -> None:
        """`req_id` leaves this role's books (shipped, failed, finished or aborted)."""
        self.live.discard(req_id)
        self.ticketed.discard(req_id)
        self.deferred.pop(req_id, None)

    def _fail(self, req_id: str, why: str) -> None:
        log.warning("prefill worker %s: transfer of %s failed: %s", self.worker_id, req_id, why)
        self._end(req_id)
        if self.engine.abort(req_id) is None:
            self.sink.cancel(req_id)
        self._send(TransferReport(self.worker_id, req_id, self.name, False, error=why))

    def pending(self) -> bool:
        # NOTE: requests waiting for their ticket need no progress (the ticket is a command, which
        # wakes the loop); only sends on their way do
        return self.transfers > self.sink.num_waiting

    @property
    def reserved(self) -> int:
        return 0

    @property
    def transfers(self) -> int:
        """Requests whose prefill is done and whose pages have not all left (waiting for a ticket,
        or in the connector)."""
        return len(self.live - self.engine.requests.keys())

    @property
    def queued(self) -> int:
        """Requests deferred by back-pressure (not in the engine yet)."""
        return len(self.deferred)

    def delta(self, out: RequestOutput) -> TokenDelta:
        """The first (and only) delta of a request here carries ALL its text so far: text held back
        because a stop string might be forming would otherwise be lost, since the decode worker
        resumes after the first token's text (it replays the first token and counts its text as
        sent). A stop string that starts in the first token and ends later thus shows its first
        characters -- the price of not shipping detokenizer state."""
        d = delta_from_output(out)
        d.text = out.outputs[0].text
        return d

    def close(self) -> None:
        self.connector.close()


def _unstarted(msg: Any) -> None:
    raise RuntimeError("PrefillRole.start was not called: the worker loop gives the role its router queue")
