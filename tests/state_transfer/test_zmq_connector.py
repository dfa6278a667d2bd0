"""ZmqConnector on loopback: bit-exact round trips (in one process and across processes), many
requests in flight, and faults that each fail one request cleanly and leave both peers serving."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from typing import Any

import msgpack
import pytest
import torch
import zmq

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages, runs_of
from pd_ssm.state_transfer import wire
from pd_ssm.state_transfer.base import Ticket
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.wire import pages_to_frames
from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector

TOKEN = "cluster-secret"


def rand(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random, never zero (a dropped or zeroed page cannot pass)."""
    return (torch.randn(shape, generator=g) + 3.0).to(dtype)


def make_pages(
    req_id: str, dtype: torch.dtype = torch.float32, seed: int = 0, ssm_layers: tuple[int, ...] = (0, 2)
) -> StatePages:
    """Hybrid by hand: SSM layers 0 and 2 (or `ssm_layers`), attention layer 1 with KV of 9 tokens."""
    g = torch.Generator().manual_seed(seed)
    req = RequestState(req_id, [5, 17, 3, 99, 2, 8, 41, 7, 1], [12], 9, {"temperature": 0.7}, 1234 + seed, 32)
    pages = StatePages(req)
    for layer in ssm_layers:
        pages.layers[layer] = LayerPages(
            layer, "ssm", {"conv": rand((48, 3), dtype, g), "ssm": rand((8, 16, 16), dtype, g)}
        )
    pages.layers[1] = LayerPages(
        1, "attention", {"k": rand((9, 2, 16), dtype, g), "v": rand((9, 2, 16), dtype, g)}
    )
    return pages


def assert_same(a: StatePages, b: StatePages) -> None:
    assert a.request == b.request and sorted(a.layers) == sorted(b.layers)
    for idx, page in a.layers.items():
        other = b.layers[idx]
        assert (page.kind, sorted(page.tensors)) == (other.kind, sorted(other.tensors))
        for name, t in page.tensors.items():
            o = other.tensors[name]
            assert o.device.type == "cpu" and o.dtype == t.dtype and o.shape == t.shape
            assert torch.equal(t.reshape(-1).view(torch.uint8), o.reshape(-1).view(torch.uint8)), (idx, name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def recv_one(rx: ZmqConnector, tx: ZmqConnector | None = None, timeout: float = 5.0) -> StatePages | None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if tx is not None:
            tx.flush(0)
        got = rx.recv(timeout=0.05)
        if got is not None:
            return got
    return None


def good_request(rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable, req_id: str = "good") -> None:
    """Both peers still serve after a fault, and nothing is left behind."""
    assert rx.address is not None
    pages = make_pages(req_id, seed=99)
    tx.send(pages, table.reserve(req_id, rx.address, slot=0))
    got = recv_one(rx, tx)
    assert got is not None
    assert_same(pages, got)
    assert tx.flush(2.0)
    assert tx.get_finished()[0] == {req_id} and rx.get_finished()[1] == {req_id}
    assert len(table) == 0 and rx.get_failed() == {} and tx.get_failed() == {}


# ------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_in_process(
    rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable, dtype: torch.dtype
) -> None:
    assert (
        rx.address is not None and rx.address.startswith("tcp://127.0.0.1:") and not rx.address.endswith(":0")
    )
    pages = make_pages("r1", dtype)
    tx.send(pages, table.reserve("r1", rx.address, slot=2, block_ids=[1, 2]))
    got = recv_one(rx, tx)
    assert got is not None
    assert_same(pages, got)
    assert tx.flush(2.0)
    sent, received = tx.get_finished()[0], rx.get_finished()[1]
    assert sent == {"r1"} and received == {"r1"} and len(table) == 0
    tx_stats, rx_stats = tx.get_stats()["r1"], rx.get_stats()["r1"]
    assert tx_stats.nbytes == pages.nbytes() and rx_stats.nbytes > pages.nbytes() and tx_stats.seconds >= 0
    assert tx.get_finished() == (set(), set())  # reported once


def _child_send(address: str, req_id: str, expiry_in: float, dtype_name: str) -> None:
    with ZmqConnector(ZmqConfig(TOKEN, send_timeout=5.0)) as tx:
        ticket = Ticket(req_id, address, 0, [], time.monotonic() + expiry_in, TOKEN)
        tx.send(make_pages(req_id, getattr(torch, dtype_name), seed=7), ticket)
        assert tx.flush(5.0) and tx.get_finished()[0] == {req_id} and not tx.get_failed()


def test_round_trip_between_processes(rx: ZmqConnector, table: ReservationTable) -> None:
    assert rx.address is not None
    table.reserve("xp", rx.address, slot=1)
    proc = mp.get_context("spawn").Process(target=_child_send, args=(rx.address, "xp", 20.0, "bfloat16"))
    proc.start()
    try:
        got = recv_one(rx, timeout=30.0)  # a spawned child imports torch first: slow on a loaded host
    finally:
        proc.join(5.0)
    assert proc.exitcode == 0
    assert got is not None
    assert_same(make_pages("xp", torch.bfloat16, seed=7), got)
    assert rx.get_finished()[1] == {"xp"} and len(table) == 0 and rx.get_failed() == {}


def test_many_requests_in_flight(rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable) -> None:
    assert rx.address is not None
    n = 80  # far beyond SNDHWM + RCVHWM (8 + 8): most wait in the sender's outbox
    sent = {
        f"m{i}": make_pages(f"m{i}", torch.bfloat16 if i % 2 else torch.float32, seed=i) for i in range(n)
    }
    for i, (req_id, pages) in enumerate(sent.items()):
        tx.send(pages, table.reserve(req_id, rx.address, slot=i))
    got: dict[str, StatePages] = {}
    end = time.monotonic() + 8.0
    while len(got) < n and time.monotonic() < end:
        tx.flush(0)
        p = rx.recv(timeout=0.02)
        if p is not None:
            assert p.req_id not in got
            got[p.req_id] = p
    assert sorted(got) == sorted(sent)
    for req_id, pages in sent.items():
        assert_same(pages, got[req_id])
    assert tx.flush(2.0)
    assert tx.get_finished()[0] == set(sent) and rx.get_finished()[1] == set(sent)
    assert len(table) == 0 and rx.recv(timeout=0.1) is None
    assert tx.get_failed() == {} and rx.get_failed() == {}


# ------------------------------------------------------------------------------------ faults


def _raw_send(address: str, parts: list[Any], token: str = TOKEN) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    sock.send_multipart([token.encode(), *[bytes(p) for p in parts]])
    sock.close()
    ctx.term()


def _flat(pages: StatePages) -> list[bytes]:
    """Parts of one message: request frame, the conv run (SSM layers 0 and 2), the ssm run, the k
    and v pages of attention layer 1, end frame -- the mangles below hit the conv run frame."""
    parts = [bytes(p) for frame in pages_to_frames(pages) for p in frame]
    assert msgpack.unpackb(parts[2])["kind"] == "run"
    return parts


def _corrupt(parts: list[bytes]) -> list[bytes]:
    payload = bytearray(parts[3])  # the first run frame's payload
    payload[5] ^= 0x40
    return [*parts[:3], bytes(payload), *parts[4:]]


def _truncate(parts: list[bytes]) -> list[bytes]:
    return [*parts[:3], parts[3][:-2], *parts[4:]]


def _duplicate(parts: list[bytes]) -> list[bytes]:
    return [*parts[:4], parts[2], parts[3], *parts[4:]]


def _drop_payload(parts: list[bytes]) -> list[bytes]:
    return parts[:-1]


def _bad_length(parts: list[bytes]) -> list[bytes]:
    """The run's header names one layer fewer than its payload holds; its checksum recomputed, so
    only the length check can tell."""
    h = msgpack.unpackb(parts[2])
    h["layers"] = h["layers"][:-1]
    h["checksum"] = wire._checksum(h, parts[3])
    return [*parts[:2], msgpack.packb(h), *parts[3:]]


@pytest.mark.parametrize(
    "mangle,reason",
    [(_corrupt, "checksum"), (_truncate, "truncated"), (_duplicate, "duplicate"), (_drop_payload, "pairs"),
     (_bad_length, "!= nbytes")],
)
def test_bad_frames_fail_the_request(
    rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable, mangle: Any, reason: str
) -> None:
    assert rx.address is not None
    table.reserve("bad", rx.address, slot=0)
    _raw_send(rx.address, mangle(_flat(make_pages("bad"))))
    assert recv_one(rx, timeout=1.0) is None
    failed = rx.get_failed()
    assert list(failed) == ["bad"] and reason in failed["bad"]
    assert len(table) == 0 and rx.get_finished() == (set(), set())
    good_request(rx, tx, table)


def test_unknown_request_id(rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable) -> None:
    assert rx.address is not None
    _raw_send(rx.address, _flat(make_pages("nobody")))
    assert recv_one(rx, timeout=1.0) is None
    failed = rx.get_failed()
    assert list(failed) == ["nobody"] and "no reservation" in failed["nobody"]
    good_request(rx, tx, table)


def test_duplicate_request_delivered_once(
    rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable
) -> None:
    assert rx.address is not None
    table.reserve("twice", rx.address, slot=0)
    parts = _flat(make_pages("twice"))
    _raw_send(rx.address, parts)
    _raw_send(rx.address, parts)
    assert recv_one(rx, timeout=2.0) is not None
    assert recv_one(rx, timeout=0.5) is None
    assert rx.get_finished()[1] == {"twice"} and "no reservation" in rx.get_failed()["twice"]
    good_request(rx, tx, table)


def test_wrong_token(rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable) -> None:
    assert rx.address is not None
    ticket = table.reserve("spoof", rx.address, slot=0)
    with ZmqConnector(ZmqConfig("not-the-token")) as intruder:
        intruder.send(make_pages("spoof"), ticket)
        assert recv_one(rx, intruder, timeout=1.0) is None
    failed = rx.get_failed()
    assert len(failed) == 1 and "wrong cluster token" in next(iter(failed.values()))
    assert "spoof" not in failed and "spoof" in table  # an intruder cannot cancel a reservation
    pages = make_pages("spoof")
    tx.send(pages, ticket)  # the real sender still gets through
    got = recv_one(rx, tx)
    assert got is not None
    assert_same(pages, got)
    assert len(table) == 0
    tx.flush(2.0)
    tx.get_finished()
    rx.get_finished()
    good_request(rx, tx, table)


def test_reservation_expired_before_arrival(tx: ZmqConnector) -> None:
    skew = [0.0]
    table = ReservationTable(ttl=5.0, token=TOKEN, clock=lambda: time.monotonic() + skew[0])
    with ZmqConnector(ZmqConfig(TOKEN), bind="tcp://127.0.0.1:0", reservations=table) as rx:
        assert rx.address is not None
        ticket = table.reserve("late", rx.address, slot=0)
        skew[0] = 6.0  # the decode host's clock passes the expiry while the pages are on their way
        tx.send(make_pages("late"), ticket)
        assert recv_one(rx, tx, timeout=1.0) is None
        assert "expired" in rx.get_failed()["late"] and len(table) == 0
        assert tx.flush(2.0) and tx.get_finished()[0] == {"late"}  # the sender did its part
        skew[0] = 0.0
        good_request(rx, tx, table)


def test_abort_on_receiving_side(rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable) -> None:
    assert rx.address is not None
    ticket = table.reserve("ab", rx.address, slot=0)
    rx.abort("ab")
    rx.abort("ab")  # idempotent
    assert len(table) == 0
    tx.send(make_pages("ab"), ticket)  # its pages arrive later and are dropped
    assert recv_one(rx, tx, timeout=1.0) is None
    assert rx.get_failed() == {} and rx.get_finished() == (set(), set())
    tx.flush(2.0)
    tx.get_finished()
    good_request(rx, tx, table)


def test_peer_gone_sender_fails_within_timeout(rx: ZmqConnector, table: ReservationTable) -> None:
    assert rx.address is not None
    dead = f"tcp://127.0.0.1:{free_port()}"
    with ZmqConnector(ZmqConfig(TOKEN, send_timeout=0.5, linger_ms=100)) as tx:
        ticket = Ticket("lost", dead, 0, [], time.monotonic() + 30.0, TOKEN)
        t0 = time.monotonic()
        tx.send(make_pages("lost"), ticket)
        assert time.monotonic() - t0 < 0.5  # send never waits for the peer
        assert tx.flush(3.0)
        assert time.monotonic() - t0 < 1.5
        failed = tx.get_failed()
        assert list(failed) == ["lost"] and "did not accept" in failed["lost"]
        assert tx.get_finished() == (set(), set())
        # a second queued request to the dead peer, aborted by the sender: reported neither way
        tx.send(make_pages("gone"), Ticket("gone", dead, 0, [], time.monotonic() + 30.0, TOKEN))
        tx.abort("gone")
        assert tx.flush(1.0) and tx.get_failed() == {} and tx.get_finished() == (set(), set())
        good_request(rx, tx, table)  # the same sender still serves live peers
        t1 = time.monotonic()
    assert time.monotonic() - t1 < 1.0  # close does not hang on the dead peer


def test_misuse_is_loud(rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable) -> None:
    assert rx.address is not None
    with pytest.raises(RuntimeError, match="only sends"):
        tx.recv(0)
    with pytest.raises(ValueError, match="names"):
        tx.send(make_pages("x"), Ticket("y", rx.address, 0, [], time.monotonic() + 5, TOKEN))
    with pytest.raises(ValueError, match="expired"):
        tx.send(make_pages("x"), Ticket("x", rx.address, 0, [], time.monotonic() - 1, TOKEN))
    with pytest.raises(ValueError, match="token"):
        ZmqConfig("")
    for retain in (0, 1 << 31):  # mallopt takes a C int
        with pytest.raises(ValueError, match="malloc_retain_bytes"):
            ZmqConfig(TOKEN, malloc_retain_bytes=retain)
    with pytest.raises(ValueError, match="both"):
        ZmqConnector(ZmqConfig(TOKEN), bind="tcp://127.0.0.1:0")
    rx.close()
    rx.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        rx.recv(0)


@pytest.mark.parametrize("threads", [1, 3])
def test_many_messages_and_checksum_threads_round_trip(threads: int) -> None:
    """A request cut into one message per layer, its frames checksummed in shares by 1 or 3 threads
    on each side, arrives bit-exact (frame order and counts survive the batching)."""
    table = ReservationTable(ttl=10.0, token=TOKEN)
    config = ZmqConfig(TOKEN, message_bytes=1, checksum_threads=threads)
    with ZmqConnector(config, bind="tcp://127.0.0.1:0", reservations=table) as rx, ZmqConnector(config) as tx:
        assert rx.address is not None
        for dtype in (torch.float32, torch.bfloat16):
            pages = make_pages(f"many-{threads}-{dtype}", dtype, seed=threads)
            tx.send(pages, table.reserve(pages.req_id, rx.address, slot=0))
            got = recv_one(rx, tx)
            assert got is not None and not rx.get_failed()
            assert_same(pages, got)
            assert tx.flush(2.0)
            assert pages.req_id in tx.get_finished()[0]


@pytest.mark.parametrize("message_bytes", [1, 3000, 32 << 20])
def test_pages_as_runs_round_trip(message_bytes: int) -> None:
    """Pages as export_pages gives them (runs) go as run frames cut at layer boundaries into
    messages, and arrive bit-exact -- as runs again (one per frame: the import's fast path when a
    message held a whole run), checked on every byte."""
    table = ReservationTable(ttl=10.0, token=TOKEN)
    config = ZmqConfig(TOKEN, message_bytes=message_bytes, edge_message_bytes=message_bytes, checksum_threads=3)
    with ZmqConnector(config, bind="tcp://127.0.0.1:0", reservations=table) as rx, ZmqConnector(config) as tx:
        assert rx.address is not None
        per_layer = make_pages(f"runs-{message_bytes}", torch.bfloat16, seed=message_bytes % 97,
                               ssm_layers=(0, 2, 3, 4, 5, 6))  # runs of 6 layers, to cut
        pages = StatePages(per_layer.request, runs=runs_of(per_layer.layers))
        tx.send(pages, table.reserve(pages.req_id, rx.address, slot=0))
        got = recv_one(rx, tx)
        assert got is not None and not rx.get_failed()
        assert got.runs is not None
        names = sorted({(r.kind, r.name) for r in got.runs})
        assert names == [("attention", "k"), ("attention", "v"), ("ssm", "conv"), ("ssm", "ssm")]
        if message_bytes == 32 << 20:  # one message: one frame per run
            assert sorted((r.name, r.layers) for r in got.runs) == sorted((r.name, r.layers) for r in runs_of(per_layer.layers))
        else:
            assert len(got.runs) > 4
        assert_same(per_layer, got)
        assert tx.flush(2.0) and tx.get_finished()[0] == {pages.req_id}
        assert tx.get_stats()[pages.req_id].nbytes == pages.nbytes()
