"""ZmqConnector: StatePages over ZMQ PUSH/PULL, a request in one or more messages.

Message = [cluster token, header_0, payload_0, header_1, payload_1, ...], frames of wire.py of one
request. `send` puts a whole request in messages of about `message_bytes` of payload each (the
last one also carries the request and end frames), so checksumming on either side overlaps the
wire; pages that come as runs go as run frames, a few per message (zmq_framing.py). Layer-wise
streaming (`send_layers`) sends the layers of each hand-over as the prefill forward finishes them;
the final `send` then carries the rest, and the end frame counts the frames of every message.
Payloads leave zero-copy (`copy=False`) from contiguous host tensors (GPU pages are first copied
into pinned host staging) and are checksummed by a small thread pool (numpy drops the GIL).

Roles by composition: a connector with `bind` (and a ReservationTable) receives; any connector
sends, keeping one PUSH socket per destination address. Queued sends make progress in `send`,
`flush` and `get_finished`, receives in `recv` / `poll`; the only threads are ZMQ's and the
checksum pool's.

Sender: a message waits in an outbox until ZMQ accepts it (IMMEDIATE: only onto a connected
peer; SNDHWM bounds ZMQ's queue); one not accepted within `send_timeout` fails its request
(`get_failed`), so a dead peer never hangs the sender. A request counts as sent once its last
message is out and ZMQ has released all its buffers (MessageTracker) -- the caller may reuse its
pages then. `abort` of a request already partly sent tells the receiver with an "abort" frame,
which the receiver reports as a failure of kind SENDER_ABORTED (base.FailureKind).

Receiver: inbox.py -- authentication, the live Ticket, per-request assembly across messages, and
the failures that cancel a reservation. Received tensors are views of the ZMQ frames (no copy). A
receiving connector tunes malloc, process-wide, to reuse freed receive buffers (zmq_malloc.py says
why; `ZmqConfig.malloc_retain_bytes` None leaves malloc alone).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, NamedTuple

import zmq
from zmq.utils.monitor import recv_monitor_message

from pd_ssm.cache.pages import LayerPages, PageRun, StatePages
from pd_ssm.state_transfer.base import StreamingConnector, Ticket, TransferFailure, TransferStats
from pd_ssm.state_transfer.inbox import Inbox
from pd_ssm.state_transfer.ledger import TransferLedger
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.wire import Parts, encode_abort, encode_end, encode_request
from pd_ssm.state_transfer.zmq_config import ZmqConfig
from pd_ssm.state_transfer.zmq_framing import (
    Sealing,
    cut,
    message_sizes,
    slabs_of_layers,
    slabs_of_runs,
    unsealed_frames,
)
from pd_ssm.state_transfer.zmq_malloc import retain_freed_memory

_MAX_ABORTED = 1 << 16  # remembered aborted ids (to drop their late messages), oldest forgotten first
# seconds `flush` blocks between pumps: bounds how late it notices a deadline or a peer's disconnect
_MAX_WAIT = 0.005


@dataclass(slots=True)
class _Stream:
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
    pieces: list[_Piece]
    deadline: float
    stream: _Stream | None  # None: an abort notice, reported to nobody
    frames: list[zmq.Frame] | None = None  # built once every piece is ready; None again once in ZMQ
    tracker: zmq.MessageTracker | None = None


class ZmqConnector(StreamingConnector):
    def __init__(
        self, config: ZmqConfig, bind: str | None = None, reservations: ReservationTable | None = None
    ) -> None:
        if (bind is None) != (reservations is None):
            raise ValueError(
                "a receiving ZmqConnector needs both `bind` and `reservations`; a sender neither"
            )
        self.config = config
        self.reservations = reservations
        self._token = config.token.encode()
        self._ctx = zmq.Context()
        self._pool = ThreadPoolExecutor(config.checksum_threads, thread_name_prefix="zmq-checksum")
        self._push: dict[str, zmq.Socket] = {}
        self._monitors: dict[str, zmq.Socket] = {}  # per PUSH socket: its peer's disconnects
        self._streams: dict[str, _Stream] = {}
        self._outbox: deque[_Outgoing] = deque()
        self._in_zmq: list[_Outgoing] = []  # accepted by ZMQ, buffers not yet released
        self.ledger = TransferLedger(_MAX_ABORTED)
        self._closed = False
        self._pull: zmq.Socket | None = None
        self._inbox: Inbox | None = None
        self.address: str | None = None
        if bind is not None:
            assert reservations is not None
            if config.malloc_retain_bytes is not None:
                retain_freed_memory(config.malloc_retain_bytes)
            pull = self._ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.RCVHWM, config.rcvhwm)
            pull.setsockopt(zmq.LINGER, 0)  # unread messages of a closing receiver are dropped
            pull.bind(bind)  # "tcp://host:0" binds a free port; `address` says which
            self.address = pull.getsockopt_string(zmq.LAST_ENDPOINT)
            self._pull = pull
            self._inbox = Inbox(self._token, reservations, self.ledger, self._pool, config.checksum_threads)

    # ------------------------------------------------------------------------------- send

    def send_layers(self, ticket: Ticket, layers: Sequence[LayerPages], ready: Any = None, last: bool = False) -> None:
        # NOTE: `last` changes nothing here: every piece leaves at once
        if ready is not None:
            raise ValueError("the ZMQ connector streams host pages, complete when handed over: no ready event")
        stream = self._stream(ticket)
        if stream.final:
            raise ValueError(f"{ticket.req_id!r}: layers sent after its final send")
        slabs = slabs_of_layers(layers)
        self._enqueue(ticket.req_id, stream, self._encode(ticket.req_id, slabs), slabs)

    def send(self, pages: StatePages, ticket: Ticket) -> None:
        if ticket.req_id != pages.req_id:
            raise ValueError(f"ticket names {ticket.req_id!r} but the pages are of {pages.req_id!r}")
        stream = self._stream(ticket)
        if stream.final:
            raise ValueError(f"{ticket.req_id!r} was sent already (its final send came twice)")
        # NOTE: runs first: asking for `pages.layers` would turn them into 128 per-layer views
        runs = pages.runs
        slabs = slabs_of_runs(runs) if runs is not None else slabs_of_layers(list(pages.layers.values()))
        sizes = message_sizes(sum(s.nbytes() for s in slabs), self.config.edge_message_bytes,
                              self.config.message_bytes)
        *early, last = cut(slabs, sizes)
        for group in early:
            self._enqueue(pages.req_id, stream, self._encode(pages.req_id, group), group)
        paged = self._encode(pages.req_id, last)
        pieces: list[_Piece] = [[encode_request(pages.request)], *paged.pieces]
        pieces.append([encode_end(pages.req_id, stream.num_frames + 1 + paged.num_frames)])
        stream.final = True
        self._enqueue(pages.req_id, stream, _Encoded(pieces, 1 + paged.num_frames), last)

    def _encode(self, req_id: str, slabs: list[PageRun]) -> _Encoded:
        """Frames of `slabs` (a page frame per one-layer slab, else a run frame), summed by the pool
        in the background: a prefill forward streaming its layers must not wait for checksums.
        A slab the wire cannot carry (e.g. a dtype it does not know) fails its request through
        get_failed when the message's turn comes, not with an exception out of a worker's step."""
        try:
            frames = unsealed_frames(req_id, slabs)
        except ValueError as e:
            return _Encoded([Sealing([], None, 1, error=str(e))], 0)
        return _Encoded([Sealing(frames, self._pool, self.config.checksum_threads)], len(frames))

    def _stream(self, ticket: Ticket) -> _Stream:
        self._check_open()
        if ticket.expired():
            raise ValueError(f"the reservation of {ticket.req_id!r} expired {-ticket.remaining():.3f} s ago")
        stream = self._streams.get(ticket.req_id)
        if stream is None:
            self.ledger.forget_abort(ticket.req_id)  # a resent request id is a new transfer
            stream = self._streams[ticket.req_id] = _Stream(ticket.address, time.monotonic())
        elif stream.address != ticket.address:
            raise ValueError(f"{ticket.req_id!r} is being sent to {stream.address}, not {ticket.address}")
        return stream

    def _enqueue(self, req_id: str, stream: _Stream, encoded: _Encoded, slabs: list[PageRun]) -> None:
        stream.num_frames += encoded.num_frames  # NOTE: without the end frame, which counts the others
        stream.nbytes += sum(s.nbytes() for s in slabs)
        stream.messages += 1
        self._queue(req_id, stream.address, encoded.pieces, stream)

    def _queue(self, req_id: str, address: str, pieces: list[_Piece], stream: _Stream | None) -> None:
        deadline = time.monotonic() + self.config.send_timeout
        self._outbox.append(_Outgoing(req_id, address, pieces, deadline, stream))
        self._pump()

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
        self._check_open()
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            self._pump()
            if not self._outbox and not self._in_zmq:
                return True
            left = _MAX_WAIT if end is None else end - time.monotonic()
            if left <= 0:
                return False
            self._wait(min(left, _MAX_WAIT))

    def _wait(self, seconds: float) -> None:
        """Block (the GIL released) until what holds up the oldest queued send may have moved:
        its checksums, room in ZMQ's queue, or ZMQ releasing its buffers -- at most `seconds`."""
        if self._outbox:
            head = self._outbox[0]
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

    def _pump(self) -> None:
        blocked: set[str] = set()  # keep per-destination order: one refusal blocks later messages
        waiting: deque[_Outgoing] = deque()
        now = time.monotonic()
        failed: set[str] = set()
        for out in self._outbox:
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
        self._outbox = deque(o for o in waiting if o.req_id not in failed)
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

    # ------------------------------------------------------------------------------- receive

    def recv(self, timeout: float | None = None) -> StatePages | None:
        self._check_open()
        if self._pull is None or self._inbox is None:
            raise RuntimeError("this ZmqConnector only sends: construct it with `bind` and `reservations`")
        self._inbox.sweep()
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not self._pull.poll(None if left is None else int(left * 1000)):
                return None
            msg = self._pull.recv_multipart(copy=False)
            pages = self._inbox.accept([f.buffer for f in msg])
            if pages is not None:
                return pages
            if end is not None and time.monotonic() >= end:
                return None

    # ------------------------------------------------------------------------------- bookkeeping

    def get_finished(self) -> tuple[set[str], set[str]]:
        if not self._closed:
            self._pump()
        return self.ledger.take_finished()

    def get_failed(self) -> dict[str, str]:
        return {req_id: f.reason for req_id, f in self.get_failures().items()}

    def get_failures(self) -> dict[str, TransferFailure]:
        """Receiver: a request whose sender aborted it (its "abort" frame) is of kind SENDER_ABORTED."""
        if self._inbox is not None and not self._closed:
            self._inbox.sweep()
        return self.ledger.take_failures()

    def get_stats(self) -> dict[str, TransferStats]:
        """Per-request TransferStats since the last call: the sender times its first send to buffers
        released, the receiver its first message to the last checked (clocks of two hosts never mix)."""
        return self.ledger.take_stats()

    def abort(self, req_id: str) -> None:
        """Sender: drop its queued messages and, once sending to its ticket had begun, tell the
        receiver (an "abort" frame) so it frees the reservation now -- also when every message was
        still being checksummed here, since the receiver holds the place either way; the receiver
        reports it as a SENDER_ABORTED failure. Receiver: cancel its reservation, drop what arrived
        and its later messages."""
        self.ledger.abort(req_id)
        self._outbox = deque(o for o in self._outbox if o.req_id != req_id)
        stream = self._streams.pop(req_id, None)
        if stream is not None and not self._closed:
            self._queue(req_id, stream.address, [[encode_abort(req_id, "aborted by the sender")]], None)
        if self._inbox is not None:
            self._inbox.abort(req_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._outbox.clear()
        self._in_zmq.clear()
        self._streams.clear()
        for monitor in self._monitors.values():
            monitor.close()
        self._monitors.clear()
        for sock in self._push.values():
            sock.close()  # LINGER bounds how long accepted messages may still flush
        self._push.clear()
        if self._pull is not None:
            self._pull.close()
        if self._inbox is not None:
            self._inbox.clear()
        self._pool.shutdown(wait=True)
        self._ctx.term()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ZmqConnector is closed")


class _Unsendable(Exception):
    pass


# a batch of wire frames of one message: ready, or being checksummed by the pool
_Piece = Sealing | list[Parts]


class _Encoded(NamedTuple):
    pieces: list[_Piece]
    num_frames: int  # frames in `pieces`


# NOTE: a tracked zero-copy frame costs ~15 us to build and a wake-up of pyzmq's garbage-collector
# thread when ZMQ lets go of it; a copy of a small part costs less (headers, conv pages, bodies)
_COPY_BELOW = 64 << 10  # bytes


def _frame(part: bytes | memoryview) -> zmq.Frame:
    """A ZMQ frame of one message part: copied when small, else zero-copy and tracked."""
    if memoryview(part).nbytes < _COPY_BELOW:
        return zmq.Frame(part)
    return zmq.Frame(part, copy=False, track=True)
