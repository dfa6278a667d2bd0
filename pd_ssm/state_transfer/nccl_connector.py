"""NcclConnector: StatePages over torch.distributed point-to-point, metadata over a ZMQ side channel.

One prefill rank (0, sends) and one decode rank (1, receives) form a two-rank process group
(`init_process_group` on a TCP init method the caller gives; backend "nccl" when the connector's
device is CUDA, "gloo" on CPU -- the same code path). Per request:

  ZMQ (PUSH -> PULL, loopback or the decode worker's data address), one multipart message:
    [cluster token, control, request header, request payload, tensors]
      control   msgpack {"req_id", "nbytes"}: the size of the p2p message that follows
      request   wire.encode_request (the RequestState, checksummed)
      tensors   msgpack list of {layer, page_kind, name, dtype, shape, offset, nbytes, checksum}
  p2p: ONE contiguous uint8 buffer holding all the request's tensors back to back (coalesced:
    per-layer messages are ~3x slower on NVLink, TARGETS.md).

Order: the metadata goes out first, then the p2p send; the receiver reads the metadata, then
posts the matching recv. Both channels are FIFO between the two ranks, so the k-th metadata
message always describes the k-th p2p message.

NOTE: stream sync: once the sender's metadata is out, its p2p send happens whatever the receiver
thinks of the request. So a refused request (wrong token, unknown / expired reservation, aborted,
bad metadata) still has its bytes received -- into a scratch buffer, then discarded -- and is
recorded in `get_failed` (aborted ones silently), and the next request lines up again. Only a
control part that cannot be parsed (no byte count) or a p2p recv that times out breaks the
stream; the connector then refuses further use and must be rebuilt.

Integrity: on CPU each tensor's bytes carry a zlib.crc32, verified on arrival. On CUDA the host
checksum would cost a device->host copy of every byte, so it is omitted (checksum None); there
the check is the consistency of lengths, offsets, dtypes and shapes plus NCCL's own transport
guarantees (its links are error-checked; it is not a network stack that can silently reorder).

The process group is the pairing (one NcclConnector per process: it owns the default group, and
`close` destroys it). There are no background threads.
"""

from __future__ import annotations

import hmac
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import msgpack
import torch
import torch.distributed as dist
import zmq

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages
from pd_ssm.state_transfer.base import Connector, Ticket, TransferStats
from pd_ssm.state_transfer.ledger import TransferLedger
from pd_ssm.state_transfer.nccl_message import TensorMeta, pack, parse_control, parse_request, parse_tensors
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.wire import (
    FrameError,
    encode_request,
)

SENDER_RANK, RECEIVER_RANK = 0, 1
_MAX_ABORTED = 1 << 16


@dataclass(slots=True)
class NcclConfig:
    token: str  # the cluster token; both peers hold the same one
    init_method: str  # "tcp://host:port" of the rendezvous (the sender's host); from config, never fixed
    device: str = "cpu"  # where p2p buffers live: "cpu" -> gloo, "cuda:N" -> nccl
    timeout: float = 30.0  # seconds: rendezvous, and the p2p recv once its metadata arrived
    send_timeout: float = 5.0  # seconds the metadata may wait for the peer to accept it
    recv_device: str | None = None  # where received tensors go; None: `device`
    backend: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("NcclConfig.token is empty: peers authenticate with the shared cluster token")
        if not self.init_method.startswith("tcp://"):
            raise ValueError(f"NcclConfig.init_method must be 'tcp://host:port', got {self.init_method!r}")
        if self.timeout <= 0 or self.send_timeout <= 0:
            raise ValueError(f"NcclConfig: timeout and send_timeout must be > 0: {self}")
        kind = torch.device(self.device).type
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"NcclConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        self.backend = "nccl" if kind == "cuda" else "gloo"


@dataclass(slots=True)
class _Outgoing:
    req_id: str
    work: Any  # torch.distributed Work
    buf: torch.Tensor  # kept alive until the send completed
    start: float
    done: bool = False


class NcclConnector(Connector):
    """Sender (rank 0): construct without `bind`; receiver (rank 1): with `bind` and `reservations`.

    The constructor joins the process group and blocks until the peer joins too (`timeout`)."""

    def __init__(
        self, config: NcclConfig, bind: str | None = None, reservations: ReservationTable | None = None
    ) -> None:
        if (bind is None) != (reservations is None):
            raise ValueError(
                "a receiving NcclConnector needs both `bind` and `reservations`; a sender neither"
            )
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed default group already exists: one NcclConnector per process"
            )
        self.config = config
        self.reservations = reservations
        self.device = torch.device(config.device)
        self.recv_device = torch.device(config.recv_device or config.device)
        self.rank = SENDER_RANK if bind is None else RECEIVER_RANK
        self._token = config.token.encode()
        self._ctx = zmq.Context()
        self._push: dict[str, zmq.Socket] = {}
        self._pull: zmq.Socket | None = None
        self.address: str | None = None
        if bind is not None:
            pull = self._ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            pull.bind(bind)  # "tcp://host:0": a free port; `address` says which
            self.address = pull.getsockopt_string(zmq.LAST_ENDPOINT)
            self._pull = pull
        self._pending: list[_Outgoing] = []
        self.ledger = TransferLedger(_MAX_ABORTED)
        self._broken: str | None = None
        self._closed = False
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            config.backend,
            init_method=config.init_method,
            rank=self.rank,
            world_size=2,
            timeout=timedelta(seconds=config.timeout),
        )

    # ------------------------------------------------------------------------------- send

    def send(self, pages: StatePages, ticket: Ticket) -> None:
        """Metadata over ZMQ, then one coalesced isend; the whole request in one call (no layer-wise
        streaming yet). A peer that does not take the metadata within `send_timeout` fails the
        request (`get_failed`) and nothing goes on the p2p stream."""
        self._check_usable()
        if self.rank != SENDER_RANK:
            raise RuntimeError("this NcclConnector receives (rank 1); only the rank-0 connector sends")
        if ticket.req_id != pages.req_id:
            raise ValueError(f"ticket names {ticket.req_id!r} but the pages are of {pages.req_id!r}")
        if ticket.expired():
            raise ValueError(f"the reservation of {ticket.req_id!r} expired {-ticket.remaining():.3f} s ago")
        self.ledger.forget_abort(pages.req_id)  # a resent request id is a new transfer
        start = time.monotonic()
        buf, metas = pack(pages, self.device)
        control = msgpack.packb({"req_id": pages.req_id, "nbytes": buf.numel()}, use_bin_type=True)
        req_header, req_payload = encode_request(pages.request)
        parts = [self._token, control, req_header, req_payload, msgpack.packb(metas, use_bin_type=True)]
        try:
            self._socket(ticket.address).send_multipart(parts)
        except zmq.Again:
            self.ledger.fail(
                pages.req_id, f"peer {ticket.address} did not take the metadata within {self.config.send_timeout} s"
            )
            return
        work = dist.isend(buf, dst=RECEIVER_RANK)
        self._pending.append(_Outgoing(pages.req_id, work, buf, start))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every p2p send completed; True if none is left (at most `timeout` s)."""
        end = time.monotonic() + (self.config.timeout if timeout is None else timeout)
        for out in self._pending:
            # NOTE: gloo's Work reports completion only through wait(), so flush waits on each
            left = max(0.001, end - time.monotonic())
            try:
                out.done = bool(out.work.wait(timeout=timedelta(seconds=left)))
            except RuntimeError:
                break
        self._reap()
        return not self._pending

    def _reap(self) -> None:
        still = []
        for out in self._pending:
            if not (out.done or out.work.is_completed()):
                still.append(out)
                continue
            self.ledger.sent(TransferStats(out.req_id, out.buf.numel(), time.monotonic() - out.start))
        self._pending = still

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._push.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, int(self.config.send_timeout * 1000))
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # only onto a live connection: a dead peer -> Again
            sock.connect(address)
            self._push[address] = sock
        return sock

    # ------------------------------------------------------------------------------- receive

    def recv(self, timeout: float | None = None) -> StatePages | None:
        self._check_usable()
        if self._pull is None:
            raise RuntimeError("this NcclConnector only sends: construct it with `bind` and `reservations`")
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not self._pull.poll(None if left is None else int(left * 1000)):
                return None
            pages = self._accept(self._pull.recv_multipart())
            if pages is not None or self._broken is not None:
                return pages
            if end is not None and time.monotonic() >= end:
                return None

    def _accept(self, msg: list[bytes]) -> StatePages | None:
        """One metadata message and its p2p bytes; the StatePages, or None with the failure recorded."""
        assert self.reservations is not None
        start = time.monotonic()
        control = parse_control(msg[1]) if len(msg) == 5 else None
        if control is None:
            self._broken = "a side-channel message without a readable byte count: the p2p stream is lost"
            self.ledger.fail_anonymous("desync", self._broken)
            return None
        req_id, nbytes = control
        buf = self._recv_bytes(req_id, nbytes)  # NOTE: always, so the stream stays in sync
        if buf is None:
            return None
        if not hmac.compare_digest(msg[0], self._token):
            self.ledger.fail_anonymous("unauthenticated", (
                f"request {req_id!r} with a wrong cluster token: {nbytes} bytes drained and dropped"
            ))
            return None
        if self.ledger.is_aborted(req_id):
            return None  # aborted here: dropped silently (the abort was the caller's own)
        table = self.reservations
        ticket = table.get(req_id)
        if ticket is None:
            self.ledger.fail(req_id, "no reservation for this request (unknown, completed or expired)")
            return None
        if ticket.expired(table.clock()):
            table.cancel(req_id)
            self.ledger.fail(req_id, "its reservation expired before the pages arrived")
            return None
        try:
            request = parse_request(msg[2], msg[3], req_id)
            metas = parse_tensors(msg[4], nbytes)
            pages = self._unpack(request, metas, buf)
        except FrameError as e:
            table.cancel(req_id)
            self.ledger.fail(req_id, f"bad metadata or bytes: {e}")
            return None
        table.complete(req_id)
        self.ledger.received(TransferStats(req_id, nbytes, time.monotonic() - start))
        return pages

    def _recv_bytes(self, req_id: str, nbytes: int) -> torch.Tensor | None:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        work = dist.irecv(buf, src=SENDER_RANK)
        assert work is not None  # None only for a rank outside the group
        try:
            ok = work.wait(timeout=timedelta(seconds=self.config.timeout))
        except RuntimeError as e:
            ok, why = False, str(e)
        else:
            why = "timed out"
        if ok is False:
            self._broken = f"p2p recv of {req_id!r} ({nbytes} B) failed: {why}"
            self.ledger.fail(req_id, self._broken)
            return None
        return buf

    def _unpack(self, request: RequestState, metas: list[TensorMeta], buf: torch.Tensor) -> StatePages:
        pages = StatePages(request)
        host = buf.numpy() if buf.device.type == "cpu" else None
        for m in metas:
            if host is not None:
                got = zlib.crc32(host[m.offset : m.offset + m.nbytes].data)
                if m.checksum is None or got != m.checksum:
                    raise FrameError(
                        f"checksum mismatch on layer {m.layer} {m.name!r}: computed {got:#010x}, sent {m.checksum}"
                    )
            # copy first, then reinterpret: the copy starts at offset 0, so the dtype view is aligned
            chunk = buf[m.offset : m.offset + m.nbytes].to(self.recv_device, copy=True)
            tensor = chunk.view(m.dtype).reshape(m.shape)
            page = pages.layers.setdefault(m.layer, LayerPages(m.layer, m.page_kind, {}))
            if page.kind != m.page_kind or m.name in page.tensors:
                raise FrameError(f"layer {m.layer}: tensor {m.name!r} repeated or page kinds disagree")
            page.tensors[m.name] = tensor
        return pages

    # ------------------------------------------------------------------------------- bookkeeping

    def get_finished(self) -> tuple[set[str], set[str]]:
        if not self._closed and self._broken is None:
            self._reap()
        return self.ledger.take_finished()

    def get_failed(self) -> dict[str, str]:
        return self.ledger.take_failed()

    def get_stats(self) -> dict[str, TransferStats]:
        """Per-request TransferStats since the last call (sender: send() to isend completed;
        receiver: metadata read to tensors unpacked)."""
        return self.ledger.take_stats()

    def abort(self, req_id: str) -> None:
        """Receiver: cancel the reservation; the request's bytes, if they come, are drained and
        dropped. Sender: a send already posted still completes (stream sync) but is not reported."""
        self.ledger.abort(req_id)
        if self.reservations is not None:
            self.reservations.cancel(req_id)

    def close(self) -> None:
        """Wait up to `send_timeout` for posted sends, then close sockets and destroy the group."""
        if self._closed:
            return
        self._closed = True
        if self._broken is None:
            self.flush(self.config.send_timeout)
        self._pending.clear()
        for sock in self._push.values():
            sock.close()
        self._push.clear()
        if self._pull is not None:
            self._pull.close()
        self._ctx.term()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this NcclConnector is closed")
        if self._broken is not None:
            raise RuntimeError(f"this NcclConnector's p2p stream is broken ({self._broken}); rebuild it")
