"""`bench transfer`, zmq part: ZmqConnector against a plain loopback TCP socket moving the same
bytes (transfer.py runs it and reports the ratio; the target is >= 0.70)."""

from __future__ import annotations

import multiprocessing
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from pd_ssm.bench.transfer import TOKEN, PageShape, check_same, make_pages, renamed

# NOTE: each receiving side runs in a spawned process of its own, as a decode worker does: a
# receiver in a thread of the sender's process would share its GIL (and a fork would inherit its
# threads). Both are timed alike: the sender's perf_counter once the receiver said it is ready, to
# the receiver's perf_counter once it holds every byte (CLOCK_MONOTONIC is system-wide on Linux).


@contextmanager
def socket_runs(nbytes: int, chunk: int, timeout: float) -> Iterator[Callable[[int], float]]:
    """A plain loopback TCP connection: `chunk`-byte sendall calls, recv_into one buffer in the
    receiving process. One connection serves every run (its connect stays out of the timing)."""
    src = torch.randint(1, 255, (nbytes,), dtype=torch.uint8).numpy().data
    with _Peer(_socket_receiver, (nbytes,), timeout) as peer, \
            socket.create_connection(("127.0.0.1", peer.recv())) as tx:

        def run(i: int) -> float:
            peer.send(i)
            peer.recv()  # the receiver waits in recv_into
            t0 = time.perf_counter()
            for off in range(0, nbytes, chunk):
                tx.sendall(src[off : off + chunk])
            seconds: float = peer.recv() - t0
            return seconds

        yield run


def _socket_receiver(conn: Connection, nbytes: int) -> None:
    """The socket baseline's receiving process: one connection, one buffer, reused by every run."""
    dst = memoryview(bytearray(nbytes))
    with socket.create_server(("127.0.0.1", 0)) as srv:
        conn.send(srv.getsockname()[1])
        rx, _addr = srv.accept()
        with rx:
            while conn.recv() is not None:
                conn.send("ready")
                _recv_exactly(rx, dst)
                conn.send(time.perf_counter())


def _recv_exactly(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError(f"loopback peer closed after {got} of {len(buf)} bytes")
        got += n


@contextmanager
def zmq_runs(kind: str, dtype_name: str, shape: PageShape, timeout: float) -> Iterator[Callable[[int], float]]:
    """ZmqConnector sender (this process) -> receiver (a spawned process), whole request per send.

    One pair of connectors serves every run, so the warm-up run connects them: like the socket
    baseline's connect, connection setup stays out of the timing (a prefill worker keeps its PUSH
    socket to a decode worker; per-run connectors timed a TCP connect and ZMTP handshake). The
    receiver builds the same pages from the same seed and compares every byte it got (untimed)."""
    from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector

    pages = make_pages("bench", kind, getattr(torch, dtype_name), shape)
    with _Peer(_zmq_receiver, (kind, dtype_name, shape, timeout), timeout) as peer, \
            ZmqConnector(ZmqConfig(TOKEN, send_timeout=timeout)) as tx:

        def run(i: int) -> float:
            req = renamed(pages, f"zmq-{i}")
            peer.send(req.req_id)
            ticket = peer.recv()  # reserved by the receiver, which now waits in recv
            t0 = time.perf_counter()
            tx.send(req, ticket)
            tx.flush(timeout)
            seconds: float = peer.recv() - t0
            if req.req_id not in tx.get_finished()[0]:
                raise RuntimeError(f"zmq bench: {req.req_id} not reported sent; failures {tx.get_failed()}")
            return seconds

        yield run


def _zmq_receiver(conn: Connection, kind: str, dtype_name: str, shape: PageShape, timeout: float) -> None:
    """The ZMQ bench's receiving process: reserves each run's request, receives it, reports the
    perf_counter at which it was whole and checked, then compares its bytes (untimed)."""
    from pd_ssm.state_transfer.reservations import ReservationTable
    from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector

    expected = make_pages("bench", kind, getattr(torch, dtype_name), shape)
    table = ReservationTable(ttl=timeout, token=TOKEN)
    with ZmqConnector(ZmqConfig(TOKEN, send_timeout=timeout), bind="tcp://127.0.0.1:0", reservations=table) as rx:
        assert rx.address is not None
        while (req_id := conn.recv()) is not None:
            conn.send(table.reserve(req_id, rx.address, slot=0))
            got = rx.recv(timeout=timeout)
            done = time.perf_counter()
            if got is None:
                raise RuntimeError(f"zmq bench: nothing arrived within {timeout} s; failures {rx.get_failed()}")
            check_same(expected, got)
            # NOTE: free its frames before the next request arrives, so malloc hands their memory
            # out again (a decode worker imports pages into its pool and drops them the same way)
            del got
            conn.send(done)


class _Peer:
    """A spawned receiving process and its end of a pipe; what it raises comes back here."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], timeout: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._timeout = timeout
        self._proc = ctx.Process(target=_serve, args=(child, target, args), daemon=True)
        self._proc.start()
        child.close()

    def send(self, obj: Any) -> None:
        self._conn.send(obj)

    def recv(self) -> Any:
        # NOTE: a spawned process imports torch first: allow for that beyond the transfer timeout
        if not self._conn.poll(self._timeout + 60.0):
            raise RuntimeError(f"bench transfer: the receiving process said nothing for {self._timeout + 60.0} s")
        msg = self._conn.recv()
        if isinstance(msg, _Failure):
            raise RuntimeError(f"bench transfer: the receiving process failed: {msg.error}")
        return msg

    def close(self) -> None:
        try:
            self._conn.send(None)  # ends its loop
        except OSError:
            pass
        self._proc.join(10.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()

    def __enter__(self) -> _Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(slots=True)
class _Failure:
    error: str


def _serve(conn: Connection, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    try:
        target(conn, *args)
    except BaseException as e:  # reported to the sender, which raises it
        conn.send(_Failure(f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


