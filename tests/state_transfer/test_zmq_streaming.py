"""ZmqConnector with layer-wise streaming: one request in several messages under one ticket.

Streamed and whole transfers must deliver bit-identical pages; a request whose pieces stop coming
(sender abort, expiry) or go wrong (duplicate layer, wrong frame count) is released on the
receiving side with nothing held, and both peers keep serving.
"""

from __future__ import annotations

import time

import pytest
import torch

from pd_ssm.cache.pages import StatePages
from pd_ssm.state_transfer.base import Ticket
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector
from tests.state_transfer.test_zmq_connector import TOKEN, assert_same, good_request, make_pages, recv_one


def stream(tx: ZmqConnector, pages: StatePages, groups: list[list[int]], rest: list[int], ticket: Ticket) -> None:
    """send_layers once per group of layer ids, then the final send with the layers in `rest`."""
    for group in groups:
        tx.send_layers(ticket, [pages.layers[i] for i in group])
    tx.send(StatePages(pages.request, {i: pages.layers[i] for i in rest}), ticket)


def drain_until_failed(rx: ZmqConnector, tx: ZmqConnector, req_id: str, timeout: float = 3.0) -> dict[str, str]:
    failed: dict[str, str] = {}
    end = time.monotonic() + timeout
    while req_id not in failed and time.monotonic() < end:
        tx.flush(0)
        assert rx.recv(timeout=0.02) is None
        failed.update(rx.get_failed())
    return failed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups,rest", [([[2], [0], [1]], []), ([[0, 2]], [1]), ([], [0, 1, 2])])
def test_streamed_equals_whole(
    rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable, dtype: torch.dtype,
    groups: list[list[int]], rest: list[int],
) -> None:
    assert rx.address is not None
    whole, streamed = make_pages("whole", dtype, seed=3), make_pages("streamed", dtype, seed=3)
    tx.send(whole, table.reserve("whole", rx.address, slot=0))
    got_whole = recv_one(rx, tx)
    ticket = table.reserve("streamed", rx.address, slot=1)
    stream(tx, streamed, groups, rest, ticket)
    got_streamed = recv_one(rx, tx)
    assert got_whole is not None and got_streamed is not None
    assert_same(whole, got_whole)
    assert_same(streamed, got_streamed)
    for idx, page in got_whole.layers.items():  # the same bytes whichever way they travelled
        for name, t in page.tensors.items():
            assert torch.equal(t.view(torch.uint8), got_streamed.layers[idx].tensors[name].view(torch.uint8))
    assert tx.flush(2.0)
    assert tx.get_finished()[0] == {"whole", "streamed"} and rx.get_finished()[1] == {"whole", "streamed"}
    stats = tx.get_stats()
    assert stats["streamed"].nbytes == streamed.nbytes() == stats["whole"].nbytes
    assert len(table) == 0 and rx.get_failed() == {} and tx.get_failed() == {}


def test_interleaved_requests(rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable) -> None:
    """Pieces of many requests interleave on one socket; each is reported only when complete."""
    assert rx.address is not None
    sent = {f"s{i}": make_pages(f"s{i}", seed=i) for i in range(12)}
    tickets = {rid: table.reserve(rid, rx.address, slot=i) for i, rid in enumerate(sent)}
    for layer in (0, 1, 2):
        for rid, pages in sent.items():
            tx.send_layers(tickets[rid], [pages.layers[layer]])
    tx.flush(2.0)
    assert rx.recv(timeout=0.2) is None  # every layer is in, but no request frame yet
    for rid, pages in sent.items():
        tx.send(StatePages(pages.request), tickets[rid])
    got: dict[str, StatePages] = {}
    while len(got) < len(sent):
        p = recv_one(rx, tx)
        assert p is not None and p.req_id not in got
        got[p.req_id] = p
    for rid, pages in sent.items():
        assert_same(pages, got[rid])
    assert len(table) == 0 and rx.get_failed() == {}


def test_sender_abort_after_some_layers_releases_the_reservation(
    rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable
) -> None:
    assert rx.address is not None
    pages = make_pages("half", seed=5)
    ticket = table.reserve("half", rx.address, slot=0)
    tx.send_layers(ticket, [pages.layers[0], pages.layers[1]])
    assert tx.flush(2.0)
    assert rx.recv(timeout=0.3) is None and "half" in table  # partly arrived: still reserved
    tx.abort("half")
    failed = drain_until_failed(rx, tx, "half")
    assert "aborted by the sender" in failed["half"]
    assert len(table) == 0
    assert tx.get_failed() == {} and tx.get_finished() == (set(), set())
    good_request(rx, tx, table)


def test_pieces_stop_coming_then_expiry_releases(rx: ZmqConnector, tx: ZmqConnector) -> None:
    """The sender dies after some layers (no abort ever comes): the decode host's expiry frees it."""
    skew = [0.0]
    table = ReservationTable(ttl=5.0, token=TOKEN, clock=lambda: time.monotonic() + skew[0])
    with ZmqConnector(ZmqConfig(TOKEN), bind="tcp://127.0.0.1:0", reservations=table) as rx2:
        assert rx2.address is not None
        pages = make_pages("orphan", seed=6)
        with ZmqConnector(ZmqConfig(TOKEN)) as dying:
            dying.send_layers(table.reserve("orphan", rx2.address, slot=0), [pages.layers[2]])
            assert dying.flush(2.0)
        assert rx2.recv(timeout=0.3) is None and "orphan" in table
        skew[0] = 6.0
        failed = drain_until_failed(rx2, tx, "orphan")
        assert "expired with only layers [2]" in failed["orphan"] and len(table) == 0
        skew[0] = 0.0
        good_request(rx2, tx, table)


def test_duplicate_layer_across_messages_fails(rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable) -> None:
    assert rx.address is not None
    pages = make_pages("dup", seed=8)
    ticket = table.reserve("dup", rx.address, slot=0)
    tx.send_layers(ticket, [pages.layers[1]])
    tx.send(pages, ticket)  # layer 1 again in the final message
    failed = drain_until_failed(rx, tx, "dup")
    assert "duplicate frame" in failed["dup"] and len(table) == 0
    assert tx.flush(2.0)
    tx.get_finished()
    good_request(rx, tx, table)


def test_layer_lost_between_messages_fails(rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable) -> None:
    """The end frame counts the frames of every message: a piece that never arrived is caught."""
    assert rx.address is not None
    pages = make_pages("lost", seed=9)
    ticket = table.reserve("lost", rx.address, slot=0)
    tx.send_layers(ticket, [pages.layers[0]])
    tx.flush(2.0)
    tx._streams["lost"].num_frames += 2  # as if a message of two frames was sent and lost
    tx.send(StatePages(pages.request, {1: pages.layers[1], 2: pages.layers[2]}), ticket)
    failed = drain_until_failed(rx, tx, "lost")
    assert "frames before end" in failed["lost"] and len(table) == 0
    tx.flush(2.0)
    tx.get_finished()
    good_request(rx, tx, table)


def test_page_that_cannot_be_encoded_fails_its_request_only(
    rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable
) -> None:
    """Checksumming runs in the background, so a page the wire cannot carry fails its request
    through get_failed (not an exception in a later, unrelated call)."""
    assert rx.address is not None
    pages = make_pages("odd", seed=2)
    pages.layers[0].tensors["conv"] = pages.layers[0].tensors["conv"].to(torch.complex64)
    tx.send(pages, table.reserve("odd", rx.address, slot=0))
    assert tx.flush(2.0)
    failed = tx.get_failed()
    assert list(failed) == ["odd"] and "could not be encoded" in failed["odd"] and "complex64" in failed["odd"]
    assert tx.get_finished() == (set(), set())
    table.cancel("odd")
    good_request(rx, tx, table)


def test_hand_over_of_several_layers_goes_as_runs_and_pages(
    rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable
) -> None:
    """One hand-over of layers 0 and 2: their small conv pages travel stacked as one run frame, their
    large SSM pages (320 KB, above zmq_framing.STACK_BELOW) as a page frame each -- and the request
    arrives bit-exact, each frame as one run of the received pages."""
    assert rx.address is not None
    pages = make_pages("mixed", seed=12)
    g = torch.Generator().manual_seed(12)
    for i in (0, 2):
        pages.layers[i].tensors["ssm"] = torch.randn(80, 1000, generator=g) + 3.0
    ticket = table.reserve("mixed", rx.address, slot=0)
    stream(tx, pages, [[0, 2]], [1], ticket)
    got = recv_one(rx, tx)
    assert got is not None and got.runs is not None
    assert sorted((r.name, r.layers) for r in got.runs) == [
        ("conv", (0, 2)), ("k", (1,)), ("ssm", (0,)), ("ssm", (2,)), ("v", (1,))
    ]
    assert_same(pages, got)
    assert len(table) == 0 and rx.get_failed() == {}
