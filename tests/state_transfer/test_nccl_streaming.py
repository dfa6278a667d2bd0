"""NcclConnector layer-wise streaming on gloo (NcclConfig.stream_layers): a request's layers go as
parts while its prefill runs (coalesced with other requests' entries), the receiver checks and holds
them, and hands the request out only with its last part -- bit-exact, each layer once, one failure
per request, nothing held after a failure. The pytest process receives; a spawned process sends (helpers from
test_nccl_connector)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from pd_ssm.cache.pages import LayerPages, StatePages
from pd_ssm.state_transfer.connector_sink import ConnectorSink
from pd_ssm.state_transfer.nccl_config import NcclConfig
from pd_ssm.state_transfer.nccl_connector import NcclConnector
from pd_ssm.state_transfer.nccl_receiver import NcclReceiver
from pd_ssm.state_transfer.reservations import ReservationTable
from tests.state_transfer.test_nccl_connector import (
    TOKEN,
    assert_same,
    collect,
    make_pages,
    pair,
    receiver,
    reserve,
    ticket,
)


def _streaming(tx: NcclConnector, stream_bytes: int = 1, part_hold: float = 0.0) -> None:
    tx.config.stream_layers = True
    tx.config.stream_bytes = stream_bytes  # 1: every send_layers call makes a part
    tx.config.part_hold = part_hold  # 0: however soon after the last message (the burst rule: its own test)


def _stream(tx: NcclConnector, req_id: str, seed: int, dtype: torch.dtype, ahead: list[list[int]]) -> None:
    """Send the layers of each group in `ahead` with send_layers, then the rest with the final send."""
    pages = make_pages(req_id, dtype, seed)
    for group in ahead:
        tx.send_layers(ticket(tx, req_id), [pages.layers[i] for i in group])
    rest = StatePages(pages.request, layers={i: p for i, p in pages.layers.items() if not any(i in g for g in ahead)})
    tx.send(rest, ticket(tx, req_id))


def _streams_and_whole(tx: NcclConnector) -> None:
    _streaming(tx)
    _stream(tx, "s1", 11, torch.float32, [[0], [1]])  # two parts, layer 2 with its last part
    tx.send(make_pages("whole", torch.bfloat16, 12), ticket(tx, "whole"))  # not streamed, same link
    _stream(tx, "s2", 13, torch.bfloat16, [[2, 0, 1]])  # every layer ahead: its last part has none
    tx.config.stream_bytes = 1 << 30  # held until the final send: no part at all
    _stream(tx, "s3", 14, torch.float32, [[1]])
    assert tx.flush(10.0)
    assert tx.get_finished()[0] == {"s1", "whole", "s2", "s3"} and tx.get_failed() == {}
    sent = tx.get_stats()  # every part's bytes count: s2's last entry has none of its own
    assert sent["s2"].nbytes >= make_pages("s2", torch.bfloat16, 13).nbytes() > 0


def _entries_read(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Per data message the receiver reads (in this process): its entries, "part" or "last"."""
    entries: list[list[str]] = []
    read = NcclReceiver._read

    def spy(self: NcclReceiver, msg: list[bytes]) -> Any:
        item = read(self, msg)
        if item is not None and item.control.kind == "data":
            entries.append(["part" if item.is_part(i) else "last" for i in range(len(item.control.req_ids))])
        return item

    monkeypatch.setattr(NcclReceiver, "_read", spy)
    return entries


def _received_exactly(rx: NcclConnector, expected: dict[str, StatePages]) -> dict[str, StatePages]:
    """Every expected request arrived, nothing failed, and each is bit-exact."""
    got, failed = collect(rx, len(expected))
    assert failed == {} and sorted(got) == sorted(expected)
    for req_id, pages in expected.items():
        assert_same(pages, got[req_id])
    return got


def test_streamed_requests_arrive_bit_exact_beside_whole_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = _entries_read(monkeypatch)
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "s1", "whole", "s2", "s3")
    with pair(table, _streams_and_whole) as rx:
        expected = {req_id: make_pages(req_id, dtype, seed) for req_id, seed, dtype in (
            ("s1", 11, torch.float32), ("whole", 12, torch.bfloat16), ("s2", 13, torch.bfloat16),
            ("s3", 14, torch.float32))}
        got = _received_exactly(rx, expected)
        for req_id, pages in expected.items():
            assert got[req_id].request == pages.request
        assert sum(e.count("part") for e in entries) == 3  # s1: 2, s2: 1, s3: none (below stream_bytes)
        # the first part found the link idle; everything after it was coalesced (gloo: until the flush)
        assert entries == [["part"], ["part", "last", "last", "part", "last", "last"]], entries
        assert len(rx._rx._streamed) == 0  # type: ignore[union-attr]
        # a streamed request's stats count every part's bytes, not only its last entry's
        stats = rx.get_stats()
        for req_id, pages in expected.items():
            assert stats[req_id].nbytes >= pages.nbytes() > 0, req_id
    assert len(table) == 0


def _burst(tx: NcclConnector) -> None:
    """Three requests handed over layer by layer back to back, under a long part_hold: the first
    layer leaves at once as a part, every later one collects with its request's final send."""
    _streaming(tx, part_hold=60.0)
    for req_id, seed in (("b1", 31), ("b2", 32), ("b3", 33)):
        pages = make_pages(req_id, torch.float32, seed)
        for layer in pages.layers.values():
            tx.send_layers(ticket(tx, req_id), [layer])
        tx.send(StatePages(pages.request, layers={}), ticket(tx, req_id))
    assert tx.flush(10.0)
    assert tx.get_finished()[0] == {"b1", "b2", "b3"} and tx.get_failed() == {}


def test_a_burst_of_streamed_layers_travels_in_few_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """NcclConfig.part_hold: layers handed over right after a message went make no part of their
    own (each entry costs both hosts a share of work the link then waits for): after the first
    part, each request goes whole with its final send -- bit-exact, its stats with every byte."""
    entries = _entries_read(monkeypatch)
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "b1", "b2", "b3")
    with pair(table, _burst) as rx:
        expected = {req_id: make_pages(req_id, torch.float32, seed) for req_id, seed in (("b1", 31), ("b2", 32),
                                                                                          ("b3", 33))}
        _received_exactly(rx, expected)
        assert [e for m in entries for e in m] == ["part", "last", "last", "last"], entries
        stats = rx.get_stats()
        for req_id, pages in expected.items():
            assert stats[req_id].nbytes >= pages.nbytes(), req_id
    assert len(table) == 0


def _held_then_layers(tx: NcclConnector) -> None:
    """w2 is held behind w1 (gloo: the link counts as busy until a flush); then the link is idle,
    and s1's first streamed layer -- not its final send -- takes w2 out."""
    _streaming(tx, part_hold=60.0)
    tx.send(make_pages("w1", torch.float32, 41), ticket(tx, "w1"))
    tx.send(make_pages("w2", torch.float32, 42), ticket(tx, "w2"))
    assert len(tx._tx._held) == 1  # type: ignore[union-attr]
    tx._tx._link_busy = lambda: False  # type: ignore[union-attr,method-assign]  # gloo cannot tell it is idle
    pages = make_pages("s1", torch.float32, 43)
    layers = list(pages.layers.values())
    tx.send_layers(ticket(tx, "s1"), layers[:1])
    assert not tx._tx._held  # type: ignore[union-attr]
    tx.send_layers(ticket(tx, "s1"), layers[1:])
    tx.send(StatePages(pages.request, layers={}), ticket(tx, "s1"))
    assert tx.flush(10.0)
    assert tx.get_finished()[0] == {"w1", "w2", "s1"} and tx.get_failed() == {}


def test_what_is_held_leaves_when_a_streamed_layer_finds_the_link_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst handed over layer by layer makes an entry only at each request's end: the requests
    held meanwhile go as soon as a send_layers call sees the link idle, not with the next entry."""
    entries = _entries_read(monkeypatch)
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "w1", "w2", "s1")
    with pair(table, _held_then_layers) as rx:
        _received_exactly(rx, {req_id: make_pages(req_id, torch.float32, seed)
                               for req_id, seed in (("w1", 41), ("w2", 42), ("s1", 43))})
        assert entries == [["last"], ["last"], ["last"]], entries  # w2 did not wait to share s1's message
    assert len(table) == 0


def test_part_hold_is_checked() -> None:
    with pytest.raises(ValueError, match="part_hold"):
        NcclConfig(TOKEN, "tcp://127.0.0.1:0", part_hold=-1.0)


def _corrupt_part_then_good(tx: NcclConnector) -> None:
    _streaming(tx)
    pages = make_pages("bad", torch.float32, 21)
    tx.send_layers(ticket(tx, "bad"), [pages.layers[0]])
    real = tx._tx._dispatch  # type: ignore[union-attr]

    def flip(out: Any) -> None:  # the second part's bytes change after its sums went into the trailer
        out.lay_out(tx._tx.device)  # type: ignore[union-attr]
        out.buf[70] ^= 0x01
        real(out)

    tx.send_layers(ticket(tx, "bad"), [pages.layers[1]])  # held: the first part is on its way
    tx._tx._dispatch = flip  # type: ignore[union-attr]
    assert tx.flush(10.0)  # the second part goes alone, mangled
    tx._tx._dispatch = real  # type: ignore[union-attr]
    tx.send(StatePages(pages.request, layers={2: pages.layers[2]}), ticket(tx, "bad"))  # dropped there
    tx.send(make_pages("good", torch.bfloat16, 22), ticket(tx, "good"))


def test_a_corrupt_part_fails_its_request_once_and_nothing_is_held() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "bad", "good")
    with pair(table, _corrupt_part_then_good) as rx:
        got, failed = collect(rx, 1)
        time.sleep(0.3)
        assert rx.recv(timeout=0.3) is None  # the bad request's data message came and went
        failed.update(rx.get_failed())
        assert list(got) == ["good"] and list(failed) == ["bad"] and "checksum" in failed["bad"]
        assert len(rx._rx._streamed) == 0 and not rx._rx._failed_streams  # type: ignore[union-attr]
    assert len(table) == 0


def _aborts_mid_stream(tx: NcclConnector) -> None:
    _streaming(tx)
    pages = make_pages("quit", torch.float32, 31)
    tx.send_layers(ticket(tx, "quit"), [pages.layers[0]])
    tx.abort("quit")
    tx.send(StatePages(pages.request, layers={1: pages.layers[1]}), ticket(tx, "quit"))  # goes nowhere
    tx.send(make_pages("good", torch.bfloat16, 32), ticket(tx, "good"))
    assert tx.flush(10.0) and tx.get_failed() == {} and tx.get_finished()[0] == {"good"}


def test_a_sender_abort_between_parts_releases_the_reservation() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "quit", "good")
    with pair(table, _aborts_mid_stream) as rx:
        got, failed = collect(rx, 1)
        assert list(got) == ["good"] and failed == {"quit": "aborted by the sender"}
        assert len(rx._rx._streamed) == 0  # type: ignore[union-attr]
    assert len(table) == 0


def _parts_then_dies(tx: NcclConnector) -> None:
    _streaming(tx)
    pages = make_pages("orphan", torch.float32, 41)
    tx.send_layers(ticket(tx, "orphan"), [pages.layers[0]])
    assert tx.flush(10.0)
    import os

    os._exit(0)  # the prefill worker dies before the request's last layers


def test_parts_of_a_request_whose_sender_died_are_released_with_its_reservation() -> None:
    from tests.state_transfer.test_nccl_connector import spawned

    now = [0.0]
    table = ReservationTable(ttl=5.0, token=TOKEN, clock=lambda: now[0])
    reserve(table, "orphan")
    with receiver(table) as rx, spawned(_run_and_exit, rx.rendezvous):
        assert isinstance(rx, NcclConnector)
        end = time.monotonic() + 10
        while len(rx._rx._streamed) == 0 and time.monotonic() < end:  # type: ignore[union-attr]
            assert rx.recv(timeout=0.05) is None
        assert "orphan" in rx._rx._streamed  # type: ignore[union-attr]  # checked and held
        now[0] = 6.0
        assert [t.req_id for t in table.expire()] == ["orphan"]  # the decode worker frees its slot
        assert rx.recv(timeout=0.05) is None
        assert len(rx._rx._streamed) == 0  # type: ignore[union-attr]  # the part's buffer went with it
    assert len(table) == 0


def _run_and_exit(rendezvous: str) -> None:
    from pd_ssm.state_transfer.nccl_config import NcclConfig

    tx = NcclConnector(NcclConfig(TOKEN, rendezvous, timeout=15.0, send_timeout=5.0))
    _parts_then_dies(tx)


def _repeats_a_layer(tx: NcclConnector) -> None:
    _streaming(tx)
    pages = make_pages("twice", torch.float32, 51)
    tx.send_layers(ticket(tx, "twice"), [pages.layers[0]])
    tx.send(pages, ticket(tx, "twice"))  # layer 0 again: a buggy engine


def test_a_layer_sent_twice_fails_the_request() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "twice")
    with pair(table, _repeats_a_layer) as rx:
        failed: dict[str, str] = {}
        end = time.monotonic() + 15.0
        while not failed and time.monotonic() < end:
            assert rx.recv(timeout=0.1) is None
            failed.update(rx.get_failed())
        assert list(failed) == ["twice"] and "twice" in failed["twice"]
    assert len(table) == 0


def test_the_sink_streams_only_when_configured() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    with receiver(table) as rx:
        assert not rx.streams and not ConnectorSink(rx).streams
        rx.config.stream_layers = True
        assert rx.streams and ConnectorSink(rx).streams


def test_layer_pages_are_what_parts_carry() -> None:
    pages = make_pages("x", torch.float32, 1)
    assert all(isinstance(p, LayerPages) for p in pages.layers.values()) and len(pages.layers) == 3
