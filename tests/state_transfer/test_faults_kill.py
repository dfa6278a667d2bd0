"""A peer SIGKILLed in the middle of a transfer, for both connectors and both directions.

Prefill (sender) killed: the decode side fails the request within its timeout, releases the
reservation, and serves a new sender. Decode (receiver) killed: the sender fails the request
within its timeouts, holds no buffer, and serves a new receiver. A sender is killed inside a step
of its send that comes before the request's last bytes can leave, so the receiver provably holds
an incomplete request; a receiver is killed inside a step of its receive that comes before the
request can be whole there (NCCL: posting the recv; ZMQ: right after it took the first of the
request's messages). Killing either a few ms after the send, as before, raced the link: on a
loaded CI host the whole request could land first.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from multiprocessing.synchronize import Event
from types import ModuleType
from typing import Any

import torch

from pd_ssm.cache.pages import StatePages
from pd_ssm.state_transfer.base import Connector, Ticket
from pd_ssm.state_transfer.nccl_config import NcclConfig
from pd_ssm.state_transfer.nccl_connector import NcclConnector
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector
from tests.state_transfer.test_nccl_connector import (
    TOKEN,
    assert_same,
    collect,
    free_port,
    make_pages,
    receiver,
    reserve,
    spawned,
    ticket,
)

BIG = 6 << 20  # fp32 elements per SSM page: 2 layers x 24 MB
SPAWN = mp.get_context("spawn")


def _die_mid_send(tx: Connector, big: StatePages, tkt: Ticket, module: ModuleType, step: str, settle: float) -> None:
    """Send `big` and die inside `module.step`, a step of that send before its last bytes can
    leave, `settle` seconds after entering it (for what did leave to land). A 5 ms sleep after the
    send, as before, raced the link on a loaded CI host: the whole request could land first."""

    def die(*args: Any) -> Any:
        time.sleep(settle)
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(module, step, die)
    tx.send(big, tkt)
    raise AssertionError(f"sending {tkt.req_id!r} never reached {module.__name__}.{step}")


def _nccl_sender_dies(rendezvous: str) -> None:
    """Dies laying out "big"'s buffer: its metadata is out (the receiver posts its recv), no byte of
    it is on the p2p stream."""
    from pd_ssm.state_transfer import nccl_batch

    big = make_pages("big", seed=2, ssm_elems=BIG)
    tx = NcclConnector(NcclConfig(TOKEN, rendezvous, timeout=10.0))
    tx.send(make_pages("warm", seed=1), ticket(tx, "warm"))
    assert tx.flush(10.0)
    _die_mid_send(tx, big, ticket(tx, "big"), nccl_batch, "fill", settle=0.5)  # the metadata lands meanwhile


def _nccl_sender_after(rendezvous: str) -> None:
    tx = NcclConnector(NcclConfig(TOKEN, rendezvous, timeout=10.0))
    tx.send(make_pages("after", torch.bfloat16, seed=3), ticket(tx, "after"))
    assert tx.flush(10.0) and tx.get_finished()[0] == {"after"}
    tx.close()


def test_nccl_sender_killed_mid_transfer() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "warm", "big", "after")
    with receiver(table, timeout=5.0) as rx:
        assert isinstance(rx, NcclConnector)
        proc = SPAWN.Process(target=_nccl_sender_dies, args=(rx.rendezvous,))
        proc.start()
        got, failed = collect(rx, 1)
        assert list(got) == ["warm"] and not failed
        end = time.monotonic() + 8.0
        while "big" not in failed and time.monotonic() < end:  # within the receiver's 5 s timeout
            assert rx.recv(timeout=0.1) is None
            failed.update(rx.get_failed())
        proc.join(5.0)
        assert proc.exitcode == -signal.SIGKILL
        assert list(failed) == ["big"] and "peer lost mid-transfer" in failed["big"], failed
        assert "big" not in table and not rx.paired  # released; waiting for a new sender
        with spawned(_nccl_sender_after, rx.rendezvous):
            got, failed = collect(rx, 1)
        assert list(got) == ["after"] and not failed
        assert_same(make_pages("after", torch.bfloat16, seed=3), got["after"])
    assert len(table) == 0


def _nccl_receiver(rendezvous: str, seen: queue.Queue[str]) -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "warm", "big", "after")
    with NcclConnector(
        NcclConfig(TOKEN, rendezvous, timeout=5.0), bind="tcp://127.0.0.1:0", reservations=table
    ) as rx:
        _serve(rx, seen)


def _nccl_receiver_dies(rendezvous: str, seen: queue.Queue[str]) -> None:
    """Receives "warm", then dies posting the recv of "big": its metadata read, its buffer
    allocated, no recv posted. Gloo moves no byte of a p2p send before the peer posted its recv
    (it waits for the peer's NOTIFY_RECV_READY), so no byte of "big" ever leaves the sender. (Dying
    after posting it would race the link again: gloo's own thread takes the bytes meanwhile.)"""
    from pd_ssm.state_transfer import nccl_group

    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "warm", "big")
    with NcclConnector(
        NcclConfig(TOKEN, rendezvous, timeout=5.0), bind="tcp://127.0.0.1:0", reservations=table
    ) as rx:
        _serve(rx, seen, last="warm")
        # NOTE: only now, paired: the pairing handshake posts a recv too
        nccl_group.PeerGroup.irecv = _die  # type: ignore[method-assign, assignment]
        _serve(rx, seen)
    raise AssertionError('receiving "big" never reached PeerGroup.irecv')


def _die(*args: Any) -> Any:
    os.kill(os.getpid(), signal.SIGKILL)


def _serve(rx: Connector, seen: queue.Queue[str], last: str = "after") -> None:
    """Receive until `last` arrived (or 15 s); report each request id ("!" if not bit-exact)."""
    end = time.monotonic() + 15.0
    while time.monotonic() < end:
        p = rx.recv(timeout=0.1)
        if p is not None:
            exact = p.req_id != "after" or _same(make_pages("after", torch.bfloat16, seed=3), p)
            seen.put(p.req_id if exact else "!" + p.req_id)
            if p.req_id == last:
                return


def _same(a: StatePages, b: StatePages) -> bool:
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


# NOTE (_FRESH_QUEUE): a process SIGKILLed after it used a multiprocessing Queue may die holding the queue's write
# lock (its feeder thread releases it after the bytes are out, and the reader can take "warm" before
# that): the restarted peer reports on a fresh queue, or its put may never go out
def test_nccl_receiver_killed_mid_transfer() -> None:
    seen: queue.Queue[str] = SPAWN.Queue()
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    proc = SPAWN.Process(target=_nccl_receiver_dies, args=(rendezvous, seen))
    proc.start()
    big = make_pages("big", seed=2, ssm_elems=BIG)
    try:
        tx = NcclConnector(NcclConfig(TOKEN, rendezvous, timeout=10.0, send_timeout=2.0))
        tx.send(make_pages("warm", seed=1), ticket(tx, "warm"))
        assert tx.flush(5.0) and seen.get(timeout=5.0) == "warm"
        tx.send(big, ticket(tx, "big"))
        proc.join(15.0)  # it dies posting the recv of "big"
        assert proc.exitcode == -signal.SIGKILL
        t0 = time.monotonic()
        tx.flush(5.0)  # True: nothing left in flight; "big" failed, not sent
        assert time.monotonic() - t0 < 5.0 and tx.in_flight == 0 and not tx.paired
        failed = tx.get_failed()
        assert list(failed) == ["big"] and ("peer" in failed["big"] or "pairing" in failed["big"]), failed
        assert tx.get_finished() == ({"warm"}, set())
    finally:
        proc.kill()
        proc.join()
    rendezvous = f"tcp://127.0.0.1:{free_port()}"  # a new decode worker
    seen = SPAWN.Queue()  # not the killed receiver's (_FRESH_QUEUE)
    with spawned(_nccl_receiver, rendezvous, seen) as proc:
        tx.pair(rendezvous)
        tx.send(make_pages("after", torch.bfloat16, seed=3), ticket(tx, "after"))
        assert tx.flush(5.0) and tx.get_finished()[0] == {"after"} and tx.get_failed() == {}
        assert seen.get(timeout=5.0) == "after"
    tx.close()


# ------------------------------------------------------------------------------------ ZMQ


def _zmq_ticket(address: str, req_id: str) -> Ticket:
    return Ticket(req_id, address, slot=0, expiry=time.monotonic() + 60.0, token=TOKEN)


def _zmq_sender_dies(address: str) -> None:
    """Streams layer 0 of "big" (flushed: it is out), then dies building its last message, the rest
    of its layers with the request and end frames: no end frame ever leaves."""
    from pd_ssm.state_transfer import zmq_connector

    big = make_pages("big", seed=2, ssm_elems=BIG)
    tx = ZmqConnector(ZmqConfig(TOKEN))
    tx.send_layers(_zmq_ticket(address, "big"), [big.layers.pop(0)])
    assert tx.flush(10.0)
    _die_mid_send(tx, big, _zmq_ticket(address, "big"), zmq_connector, "encode_end", settle=0.0)


def _zmq_sender_after(address: str, ready: Event, go: Event) -> None:
    ready.set()
    assert go.wait(10.0)  # the decode side reserved "after" (its ticket is short: not while we start)
    with ZmqConnector(ZmqConfig(TOKEN)) as tx:
        tx.send(make_pages("after", torch.bfloat16, seed=3), _zmq_ticket(address, "after"))
        assert tx.flush(10.0) and tx.get_finished()[0] == {"after"}


def test_zmq_sender_killed_mid_transfer() -> None:
    table = ReservationTable(ttl=4.0, token=TOKEN)  # the decode side's timeout for a request
    with ZmqConnector(ZmqConfig(TOKEN), bind="tcp://127.0.0.1:0", reservations=table) as rx:
        assert rx.address is not None
        reserve(table, "big")
        proc = SPAWN.Process(target=_zmq_sender_dies, args=(rx.address,))
        proc.start()
        proc.join(12.0)
        assert proc.exitcode == -signal.SIGKILL
        failed: dict[str, str] = {}
        end = time.monotonic() + 6.0
        while "big" not in failed and time.monotonic() < end:
            assert rx.recv(timeout=0.1) is None  # half a request is never handed out
            failed.update(rx.get_failed())
        assert list(failed) == ["big"] and "expired" in failed["big"], failed
        assert len(table) == 0  # released by the connector; nothing for the caller's expiry sweep
        ready, go = SPAWN.Event(), SPAWN.Event()
        with spawned(_zmq_sender_after, rx.address, ready, go):
            assert ready.wait(15.0)
            reserve(table, "after")
            go.set()
            got = None
            end = time.monotonic() + 10.0
            while got is None and time.monotonic() < end:
                got = rx.recv(timeout=0.1)
        assert got is not None and rx.get_failed() == {}
        assert_same(make_pages("after", torch.bfloat16, seed=3), got)
    assert len(table) == 0


def _zmq_receiver(address: str, seen: queue.Queue[str], ready: Event) -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "warm", "big", "after")
    with ZmqConnector(ZmqConfig(TOKEN), bind=address, reservations=table) as rx:
        ready.set()
        _serve(rx, seen)


def _zmq_receiver_dies(address: str, seen: queue.Queue[str], ready: Event, go: Event) -> None:
    """Receives "warm", then takes the first of "big"'s messages (its layer 0; the request and end
    frames come in its last) and, once `go` is set, dies there: "big" is provably incomplete here."""
    from pd_ssm.state_transfer.inbox import Inbox

    accept = Inbox.accept

    def accept_then_die(self: Inbox, msg: Any) -> Any:
        pages = accept(self, msg)
        if self.num_in_progress:  # part of "big" taken, its end frame not
            assert go.wait(15.0)
            os.kill(os.getpid(), signal.SIGKILL)
        return pages

    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "warm", "big")
    with ZmqConnector(ZmqConfig(TOKEN), bind=address, reservations=table) as rx:
        ready.set()
        _serve(rx, seen, last="warm")
        Inbox.accept = accept_then_die  # type: ignore[method-assign]
        _serve(rx, seen)
    raise AssertionError('receiving "big" never took part of it')


def test_zmq_receiver_killed_mid_transfer() -> None:
    seen: queue.Queue[str] = SPAWN.Queue()
    address = f"tcp://127.0.0.1:{free_port()}"
    big = make_pages("big", seed=2, ssm_elems=BIG)
    ready, go = SPAWN.Event(), SPAWN.Event()
    proc = SPAWN.Process(target=_zmq_receiver_dies, args=(address, seen, ready, go))
    proc.start()
    with ZmqConnector(ZmqConfig(TOKEN, send_timeout=2.0, linger_ms=100)) as tx:
        try:
            assert ready.wait(15.0)
            tx.send(make_pages("warm", seed=1), _zmq_ticket(address, "warm"))
            assert tx.flush(10.0) and seen.get(timeout=10.0) == "warm"
            tx.send(big, _zmq_ticket(address, "big"))
            # NOTE: a request counts as sent once ZMQ released its buffers, and the receiver's ZMQ
            # may take all of "big" while it lives (loopback socket buffers alone hold tens of MB): so every
            # message of "big" goes into ZMQ (one pump at a time: flush(0.0)), then no pump until
            # the sender's ZMQ saw the receiver go -- a pump fails a disconnected peer's requests
            # before it counts released buffers, and "big" is never reported sent
            while tx._outbox._queued:
                time.sleep(0.002)  # its checksums
                tx.flush(0.0)
            go.set()
            proc.join(15.0)
            assert proc.exitcode == -signal.SIGKILL
            t0 = time.monotonic()
            assert tx._outbox._monitors[address].poll(3000)  # the disconnect, seen by the sender's ZMQ
            assert tx.flush(5.0)  # nothing left waiting: no buffer held
            assert time.monotonic() - t0 < 3.0
            failed = tx.get_failed()
            assert list(failed) == ["big"] and "disconnected" in failed["big"], failed
            assert tx.get_finished() == ({"warm"}, set())
        finally:
            proc.kill()
            proc.join()
        ready.clear()
        seen = SPAWN.Queue()  # not the killed receiver's (_FRESH_QUEUE)
        with spawned(_zmq_receiver, address, seen, ready):  # restarted at the same address: ZMQ reconnects
            assert ready.wait(15.0)
            tx.send(make_pages("after", torch.bfloat16, seed=3), _zmq_ticket(address, "after"))
            assert tx.flush(10.0) and tx.get_finished()[0] == {"after"} and tx.get_failed() == {}
            assert seen.get(timeout=10.0) == "after"
