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
sends, through an Outbox (zmq_outbox.py) holding one PUSH socket per destination address. Queued
sends make progress in `send`, `flush` and `get_finished`, receives in `recv` / `poll`; the only
threads are ZMQ's and the checksum pool's.

Sender: a message waits in the outbox (zmq_outbox.py) until ZMQ accepts it (IMMEDIATE: only onto a
connected peer; SNDHWM bounds ZMQ's queue); one not accepted within `send_timeout` fails its
request (`get_failed`), so a dead peer never hangs the sender. A request counts as sent once its
last message is out and ZMQ has released all its buffers (MessageTracker) -- the caller may reuse
its pages then. `abort` of a request already partly sent tells the receiver with an "abort" frame,
which the receiver reports as a failure of kind SENDER_ABORTED (base.FailureKind).

Receiver: inbox.py -- authentication, the live Ticket, per-request assembly across messages, and
the failures that cancel a reservation. Received tensors are views of the ZMQ frames (no copy). A
receiving connector tunes malloc, process-wide, to reuse freed receive buffers (zmq_malloc.py says
why; `ZmqConfig.malloc_retain_bytes` None leaves malloc alone).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import zmq

from pd_ssm.cache.pages import LayerPages, PageRun, StatePages
from pd_ssm.state_transfer.base import StreamingConnector, Ticket, TransferFailure, TransferStats
from pd_ssm.state_transfer.inbox import Inbox
from pd_ssm.state_transfer.ledger import TransferLedger
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.wire import encode_abort, encode_end, encode_request
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
from pd_ssm.state_transfer.zmq_outbox import Outbox, Piece, Stream

_MAX_ABORTED = 1 << 16  # remembered aborted ids (to drop their late messages), oldest forgotten first


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
        self._streams: dict[str, Stream] = {}
        self.ledger = TransferLedger(_MAX_ABORTED)
        self._outbox = Outbox(self._ctx, config, self._token, self.ledger, self._streams)
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
        pieces: list[Piece] = [[encode_request(pages.request)], *paged.pieces]
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

    def _stream(self, ticket: Ticket) -> Stream:
        self._check_open()
        if ticket.expired():
            raise ValueError(f"the reservation of {ticket.req_id!r} expired {-ticket.remaining():.3f} s ago")
        stream = self._streams.get(ticket.req_id)
        if stream is None:
            self.ledger.forget_abort(ticket.req_id)  # a resent request id is a new transfer
            stream = self._streams[ticket.req_id] = Stream(ticket.address, time.monotonic())
        elif stream.address != ticket.address:
            raise ValueError(f"{ticket.req_id!r} is being sent to {stream.address}, not {ticket.address}")
        return stream

    def _enqueue(self, req_id: str, stream: Stream, encoded: _Encoded, slabs: list[PageRun]) -> None:
        stream.num_frames += encoded.num_frames  # NOTE: without the end frame, which counts the others
        stream.nbytes += sum(s.nbytes() for s in slabs)
        stream.messages += 1
        self._outbox.put(req_id, stream.address, encoded.pieces, stream)

    def flush(self, timeout: float | None = None) -> bool:
        """Push queued sends until every one is accepted or failed; True if none is left waiting.

        Waits at most `timeout` seconds (None: until each message's own send_timeout)."""
        self._check_open()
        return self._outbox.flush(timeout)

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
            self._outbox.pump()
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
        self._outbox.drop(req_id)
        stream = self._streams.pop(req_id, None)
        if stream is not None and not self._closed:
            self._outbox.put(req_id, stream.address, [[encode_abort(req_id, "aborted by the sender")]], None)
        if self._inbox is not None:
            self._inbox.abort(req_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._outbox.close()  # before the context's term: it closes the PUSH sockets
        if self._pull is not None:
            self._pull.close()
        if self._inbox is not None:
            self._inbox.clear()
        self._pool.shutdown(wait=True)
        self._ctx.term()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ZmqConnector is closed")


class _Encoded(NamedTuple):
    pieces: list[Piece]
    num_frames: int  # frames in `pieces`

