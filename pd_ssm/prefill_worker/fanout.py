"""FanoutConnector: one sending Connector over one NcclConnector per decode worker.

An NcclConnector pairs one sender with one receiver (its own two-rank group), while a prefill
worker ships to every decode worker; the ConnectorSink takes a single connector.  This one routes
each request to the child paired with its ticket's address, pairing a new child the first time
an address shows up (its `rendezvous` comes with the ticket).  ZMQ needs none of this: one
ZmqConnector sends to any address.

`streams`: the children stream layer by layer (NcclConfig.stream_layers): `send_layers` goes to
the ticket's child as `send` does. `device_pages`: they take device pages with a `ready` event
(NCCL on CUDA; base.py).

`wait_sends`: the children's sends complete only inside a blocking wait (gloo's p2p Work cannot be
polled; a wait that times out breaks the stream), so `get_finished` flushes them -- bounded by
the receiver's next poll, which the decode worker's loop makes every iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pd_ssm.cache.pages import LayerPages, StatePages
from pd_ssm.state_transfer.base import Connector, StreamingConnector, Ticket, TransferStats


class FanoutConnector(StreamingConnector):
    """`make(rendezvous)` builds a sending connector paired with the receiver hosting `rendezvous`
    (blocking until paired); its `address` must then be the one that receiver's tickets name."""

    def __init__(self, make: Callable[[str], Connector], wait_sends: bool = False, streams: bool = False,
                 device_pages: bool = False) -> None:
        self._make = make
        self._device_pages = device_pages
        self.wait_sends = wait_sends
        self._streams = streams
        self._peers: dict[str, Connector] = {}  # receiver data address -> sender paired with it
        self._owner: dict[str, Connector] = {}  # request id -> the child that sends it
        self._closed = False

    def add_peer(self, address: str, rendezvous: str) -> None:
        """Make sure a child sends to `address` (pairs through `rendezvous` the first time)."""
        if address in self._peers:
            return
        if not rendezvous:
            raise ValueError(f"no rendezvous for the receiver at {address}: the NCCL connector pairs through one")
        child = self._make(rendezvous)
        got = getattr(child, "address", None)
        if got != address:
            child.close()
            raise ValueError(f"paired through {rendezvous} with the receiver at {got}, but the ticket names {address}")
        self._peers[address] = child

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    @property
    def streams(self) -> bool:
        return self._streams

    @property
    def device_pages(self) -> bool:
        return self._device_pages

    def send(self, pages: StatePages, ticket: Ticket) -> None:
        self._child(ticket).send(pages, ticket)

    def send_layers(self, ticket: Ticket, layers: Sequence[LayerPages], ready: Any = None, last: bool = False) -> None:
        child = self._child(ticket)
        if not isinstance(child, StreamingConnector):
            raise TypeError(f"the connector paired with {ticket.address} does not stream layer by layer")
        child.send_layers(ticket, layers, ready, last)

    def _child(self, ticket: Ticket) -> Connector:
        child = self._peers.get(ticket.address)
        if child is None:
            raise ValueError(f"no connector is paired with {ticket.address} (call add_peer with its rendezvous)")
        self._owner[ticket.req_id] = child
        return child

    def recv(self, timeout: float | None = None) -> StatePages | None:
        raise RuntimeError("a FanoutConnector only sends (the prefill side)")

    def get_finished(self) -> tuple[set[str], set[str]]:
        sent: set[str] = set()
        for child in self._peers.values():
            flush = getattr(child, "flush", None)
            if self.wait_sends and flush is not None and getattr(child, "in_flight", None):
                flush()
            sent |= child.get_finished()[0]
        for req_id in sent:
            self._owner.pop(req_id, None)
        return sent, set()

    def get_failed(self) -> dict[str, str]:
        failed: dict[str, str] = {}
        for child in self._peers.values():
            failed.update(child.get_failed())
        for req_id in failed:
            self._owner.pop(req_id, None)
        return failed

    def get_stats(self) -> dict[str, TransferStats]:
        stats: dict[str, TransferStats] = {}
        for child in self._peers.values():
            take = getattr(child, "get_stats", None)
            if take is not None:
                stats.update(take())
        return stats

    def abort(self, req_id: str) -> None:
        child = self._owner.pop(req_id, None)
        if child is not None:
            child.abort(req_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for child in self._peers.values():
            child.close()
        self._peers.clear()
        self._owner.clear()
