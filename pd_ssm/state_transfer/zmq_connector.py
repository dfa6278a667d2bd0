"""ZmqConnector: StatePages over ZMQ PUSH/PULL, one multipart message per request.

Message = [cluster token, header_0, payload_0, header_1, payload_1, ...], the frames of wire.py
for one whole request (request frame, page frames, end frame). Payloads leave zero-copy
(`copy=False`) from contiguous host tensors; GPU pages are first copied into pinned host staging.

Roles by composition: a connector with `bind` (and a ReservationTable) receives; any connector
sends, keeping one PUSH socket per destination address. There are no background threads: queued
sends make progress in `send`, `flush` and `get_finished`, receives in `recv` / `poll`.

Sender: a message waits in an outbox until ZMQ accepts it (IMMEDIATE: only onto a connected
peer; SNDHWM bounds ZMQ's queue); one not accepted within `send_timeout` fails (`get_failed`),
so a dead peer never hangs the sender. A request counts as sent once ZMQ has released all its
buffers (MessageTracker) -- the caller may reuse its pages then.

Receiver: each message is authenticated (constant-time token compare), must name a request with
a live Ticket in the ReservationTable, and is decoded and assembled completely before anything is
returned; any failure drops the whole message, cancels the reservation and is reported by
`get_failed` (never raised into the caller's loop). Failures that name no request (wrong token,
unparsable first header) are keyed "!<what>-<n>": they hold nothing for the caller to release.
"""

from __future__ import annotations

import hmac
import time
from collections import deque
from dataclasses import dataclass

import msgpack
import torch
import zmq

from pd_ssm.cache.pages import LayerPages, StatePages
from pd_ssm.state_transfer.assembler import PageAssembler
from pd_ssm.state_transfer.base import Connector, Ticket, TransferStats
from pd_ssm.state_transfer.ledger import TransferLedger
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.wire import MAX_HEADER_BYTES, FrameError, decode_frame, pages_to_frames

_MAX_ABORTED = 1 << 16  # remembered aborted ids (to drop their late messages), oldest forgotten first


@dataclass(slots=True)
class ZmqConfig:
    token: str  # the cluster token; both peers hold the same one
    send_timeout: float = 5.0  # seconds a message may wait for the peer to accept it
    sndhwm: int = 8  # messages (= whole requests) ZMQ queues per peer on the send side
    rcvhwm: int = 8  # and on the receive side
    linger_ms: int = 1000  # how long close() may wait to flush accepted messages

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("ZmqConfig.token is empty: peers authenticate with the shared cluster token")
        if self.send_timeout <= 0 or self.sndhwm <= 0 or self.rcvhwm <= 0 or self.linger_ms < 0:
            raise ValueError(
                f"ZmqConfig: send_timeout, sndhwm, rcvhwm must be > 0 and linger_ms >= 0: {self}"
            )


@dataclass(slots=True)
class _Outgoing:
    req_id: str
    address: str
    frames: list[zmq.Frame] | None  # None once handed to ZMQ
    tracker: zmq.MessageTracker
    nbytes: int
    start: float  # time.monotonic()
    deadline: float


class ZmqConnector(Connector):
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
        self._push: dict[str, zmq.Socket] = {}
        self._outbox: deque[_Outgoing] = deque()
        self._in_zmq: list[_Outgoing] = []  # accepted by ZMQ, buffers not yet released
        self.ledger = TransferLedger(_MAX_ABORTED)
        self._closed = False
        self._pull: zmq.Socket | None = None
        self.address: str | None = None
        if bind is not None:
            pull = self._ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.RCVHWM, config.rcvhwm)
            pull.setsockopt(zmq.LINGER, 0)  # unread messages of a closing receiver are dropped
            pull.bind(bind)  # "tcp://host:0" binds a free port; `address` says which
            self.address = pull.getsockopt_string(zmq.LAST_ENDPOINT)
            self._pull = pull

    # ------------------------------------------------------------------------------- send

    def send(self, pages: StatePages, ticket: Ticket) -> None:
        self._check_open()
        if ticket.req_id != pages.req_id:
            raise ValueError(f"ticket names {ticket.req_id!r} but the pages are of {pages.req_id!r}")
        if ticket.expired():
            raise ValueError(f"the reservation of {ticket.req_id!r} expired {-ticket.remaining():.3f} s ago")
        self.ledger.forget_abort(pages.req_id)  # a resent request id is a new transfer
        host = _to_host(pages)
        parts = [self._token] + [p for frame in pages_to_frames(host) for p in frame]
        frames = [zmq.Frame(p, copy=False, track=True) for p in parts]
        now = time.monotonic()
        self._outbox.append(
            _Outgoing(
                pages.req_id,
                ticket.address,
                frames,
                zmq.MessageTracker(*frames),
                host.nbytes(),
                now,
                now + self.config.send_timeout,
            )
        )
        self._pump()

    def flush(self, timeout: float | None = None) -> bool:
        """Push queued sends until every one is accepted or failed; True if none is left waiting.

        Waits at most `timeout` seconds (None: until each message's own send_timeout)."""
        self._check_open()
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            self._pump()
            if not self._outbox and not self._in_zmq:
                return True
            if end is not None and time.monotonic() >= end:
                return False
            time.sleep(0.001)

    def _pump(self) -> None:
        blocked: set[str] = set()  # keep per-destination order: one refusal blocks later messages
        waiting: deque[_Outgoing] = deque()
        now = time.monotonic()
        for out in self._outbox:
            if out.address not in blocked:
                assert out.frames is not None
                try:
                    self._socket(out.address).send_multipart(out.frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    blocked.add(out.address)
                else:
                    out.frames = None  # drop our references so the tracker can complete
                    self._in_zmq.append(out)
                    continue
            # not taken: it waits for its peer until its deadline
            if now >= out.deadline:
                self._fail(out.req_id, f"peer {out.address} did not accept it within {self.config.send_timeout} s")
            else:
                waiting.append(out)
        self._outbox = waiting
        still: list[_Outgoing] = []
        for out in self._in_zmq:
            if not out.tracker.done:
                still.append(out)
            else:
                self.ledger.sent(TransferStats(out.req_id, out.nbytes, time.monotonic() - out.start))
        self._in_zmq = still

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._push.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, self.config.sndhwm)
            sock.setsockopt(zmq.LINGER, self.config.linger_ms)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only onto a live connection: a dead peer -> Again
            sock.connect(address)
            self._push[address] = sock
        return sock

    # ------------------------------------------------------------------------------- receive

    def recv(self, timeout: float | None = None) -> StatePages | None:
        self._check_open()
        if self._pull is None:
            raise RuntimeError("this ZmqConnector only sends: construct it with `bind` and `reservations`")
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not self._pull.poll(None if left is None else int(left * 1000)):
                return None
            msg = self._pull.recv_multipart(copy=False)
            pages = self._accept(msg)
            if pages is not None:
                return pages
            if end is not None and time.monotonic() >= end:
                return None

    def _accept(self, msg: list[zmq.Frame]) -> StatePages | None:
        """Check one message completely; the StatePages, or None with the failure recorded."""
        assert self.reservations is not None
        start = time.monotonic()
        if not msg or not hmac.compare_digest(msg[0].bytes, self._token):
            self.ledger.fail_anonymous("unauthenticated", (
                f"message of {len(msg)} parts with a wrong cluster token dropped"
            ))
            return None
        parts = msg[1:]
        req_id = _peek_req_id(parts[0].buffer) if parts else None
        if req_id is None:
            self.ledger.fail_anonymous("malformed", "message whose first frame names no request dropped")
            return None
        if self.ledger.is_aborted(req_id):
            return None  # aborted here: its late pages are dropped silently (abort already reported)
        table = self.reservations
        ticket = table.get(req_id)
        if ticket is None:
            self._fail(req_id, "no reservation for this request (unknown, completed or expired)")
            return None
        if ticket.expired(table.clock()):
            table.cancel(req_id)
            self._fail(req_id, "its reservation expired before the pages arrived")
            return None
        try:
            if len(parts) % 2:
                raise FrameError(
                    f"message of {req_id!r} has {len(parts)} frame parts, not [header, payload] pairs"
                )
            asm = PageAssembler(req_id)
            for i in range(0, len(parts), 2):
                asm.add(decode_frame(parts[i].buffer, parts[i + 1].buffer))
            pages = asm.result()
        except FrameError as e:
            table.cancel(req_id)
            self._fail(req_id, f"bad frame: {e}")
            return None
        table.complete(req_id)
        nbytes = sum(len(p.buffer) for p in msg)
        self.ledger.received(TransferStats(req_id, nbytes, time.monotonic() - start))
        return pages

    # ------------------------------------------------------------------------------- bookkeeping

    def get_finished(self) -> tuple[set[str], set[str]]:
        if not self._closed:
            self._pump()
        return self.ledger.take_finished()

    def get_failed(self) -> dict[str, str]:
        return self.ledger.take_failed()

    def get_stats(self) -> dict[str, TransferStats]:
        """Per-request TransferStats since the last call: the sender times send() to buffers released,
        the receiver times checking and decoding one message (clocks of two hosts never mix)."""
        return self.ledger.take_stats()

    def abort(self, req_id: str) -> None:
        """Sender: drop its queued sends (one ZMQ already took still goes out; the receiver's
        ticket then decides). Receiver: cancel its reservation and drop its later messages."""
        self.ledger.abort(req_id)
        self._outbox = deque(o for o in self._outbox if o.req_id != req_id)
        if self.reservations is not None:
            self.reservations.cancel(req_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._outbox.clear()
        self._in_zmq.clear()
        for sock in self._push.values():
            sock.close()  # LINGER bounds how long accepted messages may still flush
        self._push.clear()
        if self._pull is not None:
            self._pull.close()
        self._ctx.term()

    def _fail(self, req_id: str, reason: str) -> None:
        self.ledger.fail(req_id, reason)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ZmqConnector is closed")


def _to_host(pages: StatePages) -> StatePages:
    """CPU pages as they are (zero-copy); GPU pages copied into pinned host staging, synchronized."""
    layers: dict[int, LayerPages] = {}
    staged = False
    for idx, page in pages.layers.items():
        tensors = {}
        for name, t in page.tensors.items():
            if t.device.type == "cpu":
                tensors[name] = t.contiguous()
            else:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                tensors[name] = host
                staged = True
        layers[idx] = LayerPages(page.layer_idx, page.kind, tensors)
    if staged:
        torch.cuda.synchronize()  # the copies must land before ZMQ's I/O thread reads the staging
    return StatePages(pages.request, layers)


def _peek_req_id(header: memoryview) -> str | None:
    """The req_id a header claims, for attributing a failure; the full check is decode_frame's."""
    if len(header) > MAX_HEADER_BYTES:
        return None
    try:
        h = msgpack.unpackb(header, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except Exception:
        return None
    req_id = h.get("req_id") if isinstance(h, dict) else None
    return req_id if isinstance(req_id, str) else None


def _no_ext(code: int, data: bytes) -> object:
    raise ValueError("ext types are not allowed in frame headers")
