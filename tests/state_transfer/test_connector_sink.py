"""ConnectorSink: routes a request's streamed layers to its ticket, whatever the connector."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages
from pd_ssm.state_transfer.base import Connector, StreamingConnector, Ticket
from pd_ssm.state_transfer.connector_sink import ConnectorSink


class Recorder(Connector):
    """A connector that keeps what it is given (no transport: this tests the routing only)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, list[int]]] = []

    def send(self, pages: StatePages, ticket: Ticket) -> None:
        if ticket.expired():
            raise ValueError(f"the reservation of {ticket.req_id!r} expired")
        self.log.append(("send", ticket.req_id, sorted(pages.layers)))

    def recv(self, timeout: float | None = None) -> StatePages | None:
        return None

    def get_finished(self) -> tuple[set[str], set[str]]:
        return set(), set()

    def get_failed(self) -> dict[str, str]:
        return {}

    def abort(self, req_id: str) -> None:
        self.log.append(("abort", req_id, []))

    def close(self) -> None:
        pass


class StreamingRecorder(Recorder, StreamingConnector):
    def send_layers(self, ticket: Ticket, layers: Sequence[LayerPages], ready: Any = None, last: bool = False) -> None:
        if ticket.expired():
            raise ValueError(f"the reservation of {ticket.req_id!r} expired")
        self.log.append(("layers", ticket.req_id, [p.layer_idx for p in layers]))
        self.readies.append(ready)
        self.lasts.append(last)

    readies: list[Any]
    lasts: list[bool]

    def __init__(self) -> None:
        super().__init__()
        self.readies = []
        self.lasts = []


class DeviceRecorder(StreamingRecorder):
    """A connector that takes device pages with their ready event (as NCCL does)."""

    @property
    def device_pages(self) -> bool:
        return True


def page(i: int) -> LayerPages:
    return LayerPages(i, "ssm", {"conv": torch.randn(4, 3) + 3.0, "ssm": torch.randn(2, 4, 4) + 3.0})


def state(req_id: str) -> RequestState:
    return RequestState(req_id, [5, 6, 7], [9], 3, {}, 11, 8)


def ticket(req_id: str, ttl: float = 30.0) -> Ticket:
    return Ticket(req_id, "tcp://127.0.0.1:1", 0, [], time.monotonic() + ttl, "t")


def test_streaming_connector_gets_each_piece_at_once() -> None:
    conn = StreamingRecorder()
    sink = ConnectorSink(conn)
    sink.expect(ticket("a"))
    sink.send_layers("a", [page(0)])
    sink.send_layers("a", [page(2)])
    sink.finish(state("a"))
    assert conn.log == [("layers", "a", [0]), ("layers", "a", [2]), ("send", "a", [])]
    assert sink.num_waiting == 0


def test_other_connectors_get_the_whole_request_in_one_send() -> None:
    conn = Recorder()
    sink = ConnectorSink(conn)
    sink.expect(ticket("a"))
    for i in (0, 1, 3):
        sink.send_layers("a", [page(i)])
    assert conn.log == [] and sink.num_waiting == 1
    sink.finish(state("a"))
    assert conn.log == [("send", "a", [0, 1, 3])] and sink.num_waiting == 0


def test_late_ticket_releases_what_waited() -> None:
    conn = StreamingRecorder()
    sink = ConnectorSink(conn)
    sink.send_layers("late", [page(0)])
    sink.send_layers("late", [page(1)])
    sink.finish(state("late"))
    assert conn.log == [] and sink.num_waiting == 1
    sink.expect(ticket("late"))
    assert conn.log == [("layers", "late", [0, 1]), ("send", "late", [])] and sink.num_waiting == 0
    sink.expect(ticket("x"))
    with pytest.raises(ValueError, match="already has a ticket"):
        sink.expect(ticket("x"))


def test_expired_ticket_fails_the_request_and_drops_its_pieces() -> None:
    conn = StreamingRecorder()
    sink = ConnectorSink(conn)
    sink.expect(ticket("old", ttl=-1.0))
    sink.send_layers("old", [page(0)])  # fails here: the connector refuses the expired ticket
    sink.send_layers("old", [page(1)])  # dropped
    sink.finish(state("old"))  # dropped, and the last word on it
    assert conn.log == [("abort", "old", [])]
    failed = sink.take_failed()
    assert list(failed) == ["old"] and "expired" in failed["old"] and sink.take_failed() == {}
    assert sink.num_waiting == 0 and not sink._dead


def test_cancel_forgets_and_aborts() -> None:
    conn = Recorder()
    sink = ConnectorSink(conn)
    sink.expect(ticket("c"))
    sink.send_layers("c", [page(0)])
    sink.cancel("c")
    assert conn.log == [("abort", "c", [])] and sink.num_waiting == 0
    sink.expect(ticket("c"))  # the ticket left with the cancel: the id may be used again


def test_device_pages_pass_their_ready_event_on_even_when_held_for_the_ticket() -> None:
    """The exporter's events stand for device copies still running: every layer must reach the
    connector with the latest event recorded after it, also when it waited here for its ticket,
    and a request finished before its ticket sends its held layers with their event first."""
    assert not ConnectorSink(StreamingRecorder()).device_pages
    conn = DeviceRecorder()
    sink = ConnectorSink(conn)
    assert sink.device_pages
    e0, e1, e2 = object(), object(), object()
    sink.send_layers("a", [page(0)], e0)
    sink.send_layers("a", [page(1)], e1)  # held: no ticket yet
    sink.expect(ticket("a"))
    sink.send_layers("a", [page(2)], e2, last=True)
    sink.finish(state("a"))
    assert conn.log == [("layers", "a", [0, 1]), ("layers", "a", [2]), ("send", "a", [])]
    assert conn.readies == [e1, e2] and conn.lasts == [False, True]
    sink.send_layers("b", [page(0)], e0)
    sink.finish(state("b"))  # before its ticket: waits here, layers and event with it
    assert sink.num_waiting == 1
    sink.expect(ticket("b"))
    assert conn.log[3:] == [("layers", "b", [0]), ("send", "b", [])] and conn.readies[2:] == [e0]
    assert sink.num_waiting == 0
    conn = DeviceRecorder()
    sink = ConnectorSink(conn)
    sink.send_layers("c", [page(0), page(1)], e0, last=True)  # all its layers before its ticket
    sink.expect(ticket("c"))  # they still go as its last layers: its final send carries none
    sink.finish(state("c"))
    assert conn.log == [("layers", "c", [0, 1]), ("send", "c", [])] and conn.lasts == [True]
