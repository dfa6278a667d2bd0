"""Outbox: the sending half of the ZmqConnector -- queued messages out, through one PUSH socket per
destination address.

A message waits here until its checksums are done and ZMQ accepts it (IMMEDIATE: only onto a
connected peer; SNDHWM bounds ZMQ's queue); one not accepted within `send_timeout` fails its
request. A request counts as sent once its last message is out and ZMQ has released all its
buffers (MessageTracker); a peer that disconnects while a message is inside ZMQ fails its request.
The outbox reports to the TransferLedger and shares the live Streams with the connector, which
creates them and drops them on abort.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from pd_ssm.state_transfer.base import TransferStats
from pd_ssm.state_transfer.ledger import TransferLedger
from pd_ssm.state_transfer.wire import Parts
from pd_ssm.state_transfer.zmq_config import ZmqConfig
from pd_ssm.state_transfer.zmq_framing import Sealing

# seconds `flush` blocks between pumps: bounds how late it notices a deadline or a peer's disconnect
_MAX_WAIT = 0.005

# a batch of wire frames of one message: ready, or being checksummed by the pool
Piece = Sealing | list[Parts]


@dataclass(slots=True)
class Stream:
    """One request on its way out, over one or more messages."""

    address: str
    start: float  # time.monotonic() of its first message
    nbytes: int = 0  # tensor bytes handed over so far
    num_frames: int = 0  # frames queued so far (the end frame's count)
    messages: int = 0  # messages queued or inside ZMQ whose buffers are not yet released
    final: bool = False  # its last message (request + end frames) is queued


@dataclass(slots=True)
class _Outgoing:
    req_id: str
    address: str
    # batches of wire.py frames; the pool may still be checksumming some (the caller never waits)
    pieces: list[Piece]
    deadline: float
    stream: Stream | None  # None: an abort notice, reported to nobody
    frames: list[zmq.Frame] | None = None  # built once every piece is ready; None again once in ZMQ
    tracker: zmq.MessageTracker | None = None


class Outbox:
    def __init__(
        self, ctx: zmq.Context, config: ZmqConfig, token: bytes, ledger: TransferLedger,
        streams: dict[str, Stream],
    ) -> None:
        self.config = config
        self.ledger = ledger
        self._ctx = ctx
        self._token = token
        self._streams = streams  # NOTE: the connector's own dict: it adds streams and drops aborted ones
        self._push: dict[str, zmq.Socket] = {}
        self._monitors: dict[str, zmq.Socket] = {}  # per PUSH socket: its peer's disconnects
        self._queued: deque[_Outgoing] = deque()
        self._in_zmq: list[_Outgoing] = []  # accepted by ZMQ, buffers not yet released

    def put(self, req_id: str, address: str, pieces: list[Piece], stream: Stream | None) -> None:
        deadline = time.monotonic() + self.config.send_timeout
        self._queued.append(_Outgoing(req_id, address, pieces, deadline, stream))
        self.pump()

    def drop(self, req_id: str) -> None:
        """Forget the queued messages of `req_id` (those inside ZMQ go on)."""
        self._queued = deque(o for o in self._queued if o.req_id != req_id)

    def _frames(self, out: _Outgoing) -> list[zmq.Frame] | None:
        """The message's zero-copy ZMQ frames once every piece is checksummed, else None."""
        if out.frames is None:
            sealing = [p for p in out.pieces if isinstance(p, Sealing)]
            if any(s.pending() for s in sealing):
                return None
            for s in sealing:
                failure = s.failure()
                if failure is not None:
                    raise _Unsendable(f"a page could not be encoded: {failure}")
            batches = (p.seal() if isinstance(p, Sealing) else p for p in out.pieces)
            parts = [self._token, *(part for batch in batches for frame in batch for part in frame)]
            out.frames = [_frame(p) for p in parts]
            out.tracker = zmq.MessageTracker(*(f for f in out.frames if f.tracker is not None))
            out.pieces = []
        return out.frames

    def flush(self, timeout: float | None = None) -> bool:
        """Push queued sends until every one is accepted or failed; True if none is left waiting.

        Waits at most `timeout` seconds (None: until each message's own send_timeout)."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            self.pump()
            if not self._queued and not self._in_zmq:
                return True
            left = _MAX_WAIT if end is None else end - time.monotonic()
            if left <= 0:
                return False
            self._wait(min(left, _MAX_WAIT))

    def _wait(self, seconds: float) -> None:
        """Block (the GIL released) until what holds up the oldest queued send may have moved:
        its checksums, room in ZMQ's queue, or ZMQ releasing its buffers -- at most `seconds`."""
        if self._queued:
            head = self._queued[0]
            pending = [f for p in head.pieces if isinstance(p, Sealing) for f in p.pending()]
            if pending:
                wait_futures(pending, timeout=seconds)
                return
            sock = self._push.get(head.address)
            if sock is not None:
                sock.poll(max(1, int(seconds * 1000)), zmq.POLLOUT)
                return
        elif self._in_zmq:
            tracker = self._in_zmq[0].tracker
            assert tracker is not None
            try:
                tracker.wait(seconds)
            except zmq.NotDone:
                pass
            return
        time.sleep(seconds)

    def pump(self) -> None:
        blocked: set[str] = set()  # keep per-destination order: one refusal blocks later messages
        waiting: deque[_Outgoing] = deque()
        now = time.monotonic()
        failed: set[str] = set()
        for out in self._queued:
            if out.req_id in failed:
                continue
            if out.address not in blocked:
                try:
                    frames = self._frames(out)
                    if frames is None:  # still being checksummed: it and what follows it wait
                        raise zmq.Again()
                    self._socket(out.address).send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    blocked.add(out.address)
                except _Unsendable as e:  # the caller's pages, not the peer: this request fails alone
                    self._streams.pop(out.req_id, None)
                    failed.add(out.req_id)
                    self.ledger.fail(out.req_id, str(e))
                    continue
                else:
                    out.frames = None  # drop our references so the tracker can complete
                    self._in_zmq.append(out)
                    continue
            # not taken: it waits for its peer until its deadline
            if now >= out.deadline:
                # an abort notice that cannot go out is dropped: the receiver's expiry frees the place
                if out.stream is not None:
                    self._streams.pop(out.req_id, None)
                    failed.add(out.req_id)
                    self.ledger.fail(out.req_id, f"peer {out.address} did not accept it within {self.config.send_timeout} s")
            else:
                waiting.append(out)
        # NOTE: a failed request's later messages go nowhere (earlier ones the peer drops at expiry)
        self._queued = deque(o for o in waiting if o.req_id not in failed)
        self._fail_disconnected()
        still: list[_Outgoing] = []
        for out in self._in_zmq:
            assert out.tracker is not None
            if not out.tracker.done:
                still.append(out)
                continue
            stream = out.stream
            if stream is None or self._streams.get(out.req_id) is not stream:
                continue  # an abort notice, or a message of a request aborted or failed since
            stream.messages -= 1
            if stream.final and stream.messages == 0:
                del self._streams[out.req_id]
                self.ledger.sent(TransferStats(out.req_id, stream.nbytes, time.monotonic() - stream.start))
        self._in_zmq = still

    def _fail_disconnected(self) -> None:
        """A peer that went away while a message was inside ZMQ: fail its request (ZMQ would report
        it sent: dropping a message releases its buffers too), and drop the socket, since a
        connecting socket keeps what it queued for whoever binds the address next."""
        for address, monitor in list(self._monitors.items()):
            lost = False
            while monitor.poll(0):
                lost |= recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            if not lost:
                continue
            for out in self._in_zmq:
                if out.address == address and out.stream is not None and self._streams.get(out.req_id) is out.stream:
                    del self._streams[out.req_id]
                    self.ledger.fail(out.req_id, f"peer {address} disconnected while it was in flight")
            monitor.close()
            del self._monitors[address]
            self._push.pop(address).close(linger=0)  # its queued messages are dropped: trackers complete

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._push.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, self.config.sndhwm)
            sock.setsockopt(zmq.LINGER, self.config.linger_ms)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only onto a live connection: a dead peer -> Again
            self._monitors[address] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(address)
            self._push[address] = sock
        return sock

    def close(self) -> None:
        """Drop what waits, then close the sockets; the connector terminates the context after."""
        self._queued.clear()
        self._in_zmq.clear()
        self._streams.clear()
        for monitor in self._monitors.values():
            monitor.close()
        self._monitors.clear()
        for sock in self._push.values():
            sock.close()  # LINGER bounds how long accepted messages may still flush
        self._push.clear()


class _Unsendable(Exception):
    pass


# NOTE: a tracked zero-copy frame costs ~15 us to build and a wake-up of pyzmq's garbage-collector
# thread when ZMQ lets go of it; a copy of a small part costs less (headers, conv pages, bodies)
_COPY_BELOW = 64 << 10  # bytes


def _frame(part: bytes | memoryview) -> zmq.Frame:
    """A ZMQ frame of one message part: copied when small, else zero-copy and tracked."""
    if memoryview(part).nbytes < _COPY_BELOW:
        return zmq.Frame(part)
    return zmq.Frame(part, copy=False, track=True)
