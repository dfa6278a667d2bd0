"""ConnectorSink: the prefill side's PageSink over a Connector, one Ticket per request.

The engine's LayerExporter hands over a request's layers as its forward finishes them, then its
state after the first token -- or, for a connector that takes whole requests (`streams` False),
the whole request at once after the forward (`finish_pages`: pages as export_pages makes them,
runs and all, so the NCCL connector sends them without per-layer work). The sink routes them to
the request's Ticket: a StreamingConnector gets each piece at once (`send_layers`), any other
connector the whole request in the final `send`. The ticket may come later than the first
layers (the prefill side starts computing before the decode side answered); layers wait here
until it does, and a request finished before its ticket came is sent when the ticket arrives.

Device pages (`device_pages`: the connector streams from GPU memory) come with the event that
says they are complete (`ready`); the sink passes the latest one on with them (the exporter
records them in order on one stream, so it covers every earlier layer too).

A ticket that expired before a piece could leave fails the request here (`take_failed`) and
aborts it on the connector: no exception reaches the engine's step loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages
from pd_ssm.state_transfer.base import Connector, StreamingConnector, Ticket


class ConnectorSink:
    def __init__(self, connector: Connector) -> None:
        self.connector = connector
        self.streams = isinstance(connector, StreamingConnector) and connector.streams
        self.device_pages = self.streams and bool(getattr(connector, "device_pages", False))
        self._tickets: dict[str, Ticket] = {}
        self._held: dict[str, list[LayerPages]] = {}  # layers not handed to the connector yet
        self._ready: dict[str, Any] = {}  # device_pages: the latest `ready` of each request's held layers
        self._complete: set[str] = set()  # requests whose held layers include their last (`last`)
        self._done: dict[str, StatePages] = {}  # finished before their ticket came
        self._failed: dict[str, str] = {}  # reported by take_failed
        self._dead: set[str] = set()  # failed: their later pieces are dropped until finish / cancel

    def expect(self, ticket: Ticket) -> None:
        """The decode side's ticket for a request: what waited for it goes out now."""
        req_id = ticket.req_id
        if req_id in self._tickets:
            raise ValueError(f"request {req_id!r} already has a ticket (slot {self._tickets[req_id].slot})")
        self._tickets[req_id] = ticket
        if self.streams and self._held.get(req_id):
            ready, last = self._ready.pop(req_id, None), req_id in self._complete
            self._complete.discard(req_id)
            self._guard(req_id, lambda: self._stream(ticket, self._held.pop(req_id), ready, last))
        pages = self._done.pop(req_id, None)
        if pages is not None:
            self.finish_pages(pages)

    def send_layers(self, req_id: str, layers: list[LayerPages], ready: Any = None, last: bool = False) -> None:
        ticket = self._tickets.get(req_id)
        if req_id in self._dead:
            return
        if ticket is None or not self.streams:
            self._held.setdefault(req_id, []).extend(layers)
            if ready is not None:
                self._ready[req_id] = ready
            if last:
                self._complete.add(req_id)
            return
        self._guard(req_id, lambda: self._stream(ticket, layers, ready, last))

    def finish(self, request: RequestState) -> None:
        self.finish_pages(StatePages(request))

    def finish_pages(self, pages: StatePages) -> None:
        """The request's last call: its final state and the layers not handed over before (those
        held here join them when it leaves)."""
        req_id = pages.req_id
        if req_id in self._dead:
            self._dead.discard(req_id)  # its last call: nothing more will come for it
            return
        ticket = self._tickets.get(req_id)
        if ticket is None:
            self._done[req_id] = pages
            return
        del self._tickets[req_id]
        held = self._held.pop(req_id, None)
        ready = self._ready.pop(req_id, None)
        self._complete.discard(req_id)
        if held and ready is not None:  # device pages held for the ticket: they go with their event
            self._guard(req_id, lambda: self._stream(ticket, held, ready))
            if req_id in self._dead:
                self._dead.discard(req_id)
                return
        elif held:
            pages.layers.update((p.layer_idx, p) for p in held)
        self._guard(req_id, lambda: self.connector.send(pages, ticket))
        self._dead.discard(req_id)  # its last call either way

    def cancel(self, req_id: str) -> None:
        self._forget(req_id)
        self._dead.discard(req_id)
        self.connector.abort(req_id)

    def take_failed(self) -> dict[str, str]:
        """Requests whose ticket expired before their pages could leave, since the last call."""
        failed, self._failed = self._failed, {}
        return failed

    @property
    def num_waiting(self) -> int:
        """Requests holding layers or a finished state here (waiting for a ticket or their end)."""
        return len(self._held.keys() | self._done.keys())

    def _stream(self, ticket: Ticket, layers: list[LayerPages], ready: Any = None, last: bool = False) -> None:
        assert isinstance(self.connector, StreamingConnector)
        self.connector.send_layers(ticket, layers, ready=ready, last=last)

    def _guard(self, req_id: str, send: Callable[[], None]) -> None:
        try:
            send()
        except ValueError as e:  # expired ticket: the decode side has let the place go
            self._forget(req_id)
            self._dead.add(req_id)
            self._failed[req_id] = str(e)
            self.connector.abort(req_id)

    def _forget(self, req_id: str) -> None:
        self._tickets.pop(req_id, None)
        self._held.pop(req_id, None)
        self._ready.pop(req_id, None)
        self._complete.discard(req_id)
        self._done.pop(req_id, None)
