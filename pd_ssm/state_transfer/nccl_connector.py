"""NcclConnector: StatePages over a private two-rank torch.distributed group, metadata over ZMQ.

One sender (prefill side, rank 0) and one receiver (decode side, rank 1) per connector pair, on a
group of their own (nccl_group.py: not torch.distributed's default group, so any number of
connectors and a default group coexist in one process). Backend "nccl" when the connector's
device is CUDA, "gloo" on CPU -- the same code path. Per data message (nccl_control.py,
nccl_message.py, nccl_unpack.py):

  ZMQ PUSH -> PULL: [token, control{kind="data", gen, req_ids, sizes}, then per request: request
       frame (header, payload), runs list]
  p2p: ONE buffer, the requests' parts back to back (sum(sizes) bytes; per-layer messages are
       ~3x slower on NVLink, TARGETS.md), then the trailer of the sender's block sums, sent from
       device memory and received into device memory; a run is the same-named tensors of the
       layers stacked (export_pages makes pages in that form), handed out as views of the
       received buffer, each run's blocks checked against the trailer (nccl_checksum.py) and its
       header against its crc32.

A message carries one request, or several: a request sent while an earlier message is still on
its way is held and goes out with the others held then (nccl_batch.py, nccl_coalesce.py); a lone
request is never held. Every check, failure and abort stays per request.

Order: the sender sends the metadata first (planned on the host, no byte copied yet), then lays
the buffer out with its sums trailer and posts the p2p send, never waiting for the device
(nccl_sender.py); the receiver reads the metadata, then posts the matching recv
(and those of the messages behind it, up to `recv_window` bytes, while it checks one), parsing a
message's request frames and run headers while its bytes travel (nccl_inbound.py). Both channels
are FIFO between the two peers, so the k-th data message of a generation describes its k-th p2p
message. By default a request leaves whole, after the prefill forward (the link moves a 2.7B
request in ~0.5 ms, against ~26 ms for the prefill in CUDA graphs). With
`NcclConfig.stream_layers` it streams instead (`send_layers`): layers go as parts of
~`stream_bytes` while the forward runs (entries without a request frame, coalesced as requests
are; host layers handed over within `part_hold` of the last message collect into larger parts,
since a burst is bound by the hosts' work per entry), the receiver checks and holds them, and the
request's last entry brings the rest and the count of parts before it; it is handed out only
then, with every layer checked once (nccl_streamed.py). From a graph prefill the layers are device snapshots with a `ready` event:
their part's metadata leaves at once and its layout and send wait on the device (nccl_sender.py),
so the receiver may hold a posted recv for up to a prefill step (a poll does not wait for it).

Pairing and recovery (the design of issue 4's "a peer dies mid-transfer"):
  - The receiver hosts the rendezvous store (`rendezvous`, "tcp://host:0" for a free port) and
    publishes its data address in it. A sender pairs in its constructor: it takes a new
    generation number from the store, sends an authenticated "hello" over ZMQ, and both build the
    group of that generation (the receiver when its recv loop reads the hello). A newer hello
    always wins: a restarted sender replaces its dead predecessor without the receiver noticing
    the death first.
  - Every data message names its generation. One of a generation that is gone (sent by a dead
    sender before it died) fails its request at once: its bytes will never come.
  - A p2p op that fails or exceeds `timeout` (gloo: "connection closed" the moment the peer dies;
    NCCL: a hang, bounded by our wait, then the communicator is aborted) fails every request of
    every message in flight (held ones too, on the sender), releases their reservations and tears
    the group down. The receiver then waits for a new hello;
    the sender re-pairs on its next `send` (with `rendezvous`, or the one given to `pair`).
  - The side channel is one-way, so a receiver that drops a generation says so in the store
    (`dropped_key`), and the sender probes it in `flush` / `get_finished` / `get_failed` through a
    client with a 1 s timeout: that is also how it learns of a dead receiver whose death gloo does
    not report (a send whose recv was never posted) -- the store went with it.
  - Abort: on the receiver it cancels the reservation and drops the bytes when they come; on the
    sender it sends an "abort" control, and the receiver releases the reservation at once if the
    request has not arrived, reporting a failure of kind SENDER_ABORTED (one already sent is
    delivered: its bytes are on the stream; one still held never leaves, and its message's other
    requests go without it).
  - Stream sync: once a data message of the live generation is read, its bytes are received
    whatever the receiver thinks of the request (wrong token, unknown / expired / aborted, bad
    metadata), into the buffer and then dropped, so the next request lines up. Only a control part
    that cannot be parsed (no byte count) loses the stream; that also tears the group down.
There are no background threads: the receiver progresses in `recv` / `poll`, the sender in `send`,
`flush` and (NCCL only: gloo's p2p Work cannot be polled) `get_finished`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

from pd_ssm.cache.pages import LayerPages, StatePages
from pd_ssm.state_transfer.base import StreamingConnector, Ticket, TransferFailure, TransferStats
from pd_ssm.state_transfer.ledger import TransferLedger
from pd_ssm.state_transfer.nccl_config import NcclConfig
from pd_ssm.state_transfer.nccl_receiver import NcclReceiver
from pd_ssm.state_transfer.nccl_sender import NcclSender
from pd_ssm.state_transfer.reservations import ReservationTable

__all__ = ["NcclConfig", "NcclConnector"]

_MAX_ABORTED = 1 << 16


class NcclConnector(StreamingConnector):
    """Sender: construct without `bind` (pairs at once, blocking up to `timeout`; RuntimeError if no
    receiver joins); receiver: with `bind` and `reservations` (hosts the rendezvous at once; a sender
    may pair any time after, through its recv loop). The role is composed in, not flagged."""

    def __init__(
        self, config: NcclConfig, bind: str | None = None, reservations: ReservationTable | None = None
    ) -> None:
        if (bind is None) != (reservations is None):
            raise ValueError(
                "a receiving NcclConnector needs both `bind` and `reservations`; a sender neither"
            )
        if config.backend == "nccl":
            import torch

            torch.cuda.set_device(torch.device(config.device))
        self.config = config
        self.reservations = reservations
        self.ledger = TransferLedger(_MAX_ABORTED)
        self._ctx = zmq.Context()
        self._closed = False
        self._tx: NcclSender | None = None
        self._rx: NcclReceiver | None = None
        try:
            if bind is None:
                self._tx = NcclSender(config, self.ledger, self._ctx)
                self._tx.pair()
            else:
                assert reservations is not None
                self._rx = NcclReceiver(config, self.ledger, self._ctx, bind, reservations)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str | None:
        """Receiver: its ZMQ data address (tickets name it); sender: that of the receiver it is paired with."""
        return self._rx.address if self._rx is not None else self._tx.address if self._tx is not None else None

    @property
    def rendezvous(self) -> str:
        """Receiver: where senders pair (port resolved); sender: where it pairs next."""
        if self._rx is not None:
            return self._rx.rendezvous
        assert self._tx is not None
        return self._tx.rendezvous

    @property
    def paired(self) -> bool:
        return (self._rx or self._tx).paired  # type: ignore[union-attr]

    @property
    def in_flight(self) -> int:
        """Sender: requests held or posted and not completed (a posted message holds its buffer);
        receiver: messages whose recv is posted ahead (`recv_window`) and not completed yet."""
        if self._tx is not None:
            return self._tx.in_flight
        return self._rx.in_flight if self._rx is not None else 0

    # ------------------------------------------------------------------------------- send

    def pair(self, rendezvous: str | None = None) -> None:
        """Sender: (re)pair with the receiver hosting `rendezvous` (default: the current one).
        Sends in flight on the old pairing fail. RuntimeError if no receiver joins within `timeout`."""
        self._sender().pair(rendezvous)

    def send(self, pages: StatePages, ticket: Ticket) -> None:
        """The request -- whole, or its last part after `send_layers` (module docstring): posted
        at once if the link is idle, else held and coalesced with the requests sent meanwhile
        (posted by the next call that is not a `send`, or when they reach `coalesce_bytes`). Its
        metadata goes over ZMQ. Failures -- no receiver to re-pair with,
        metadata not taken within `send_timeout`, the p2p stream broken -- go to `get_failed`."""
        tx = self._sender()
        if ticket.req_id != pages.req_id:
            raise ValueError(f"ticket names {ticket.req_id!r} but the pages are of {pages.req_id!r}")
        _check_live(ticket)
        self.ledger.forget_abort(pages.req_id)  # a resent request id is a new transfer
        tx.send(pages, ticket)

    @property
    def streams(self) -> bool:
        return self.config.stream_layers

    @property
    def device_pages(self) -> bool:
        """NCCL sends from GPU memory: streamed layers may be device tensors with a `ready` event."""
        return self.config.backend == "nccl"

    def send_layers(self, ticket: Ticket, layers: Sequence[LayerPages], ready: Any = None, last: bool = False) -> None:
        """Layer-wise streaming (`NcclConfig.stream_layers`): some layers of a request ahead of its
        final `send`; they leave as a part once `stream_bytes` of them are held, or with `last`
        (the request's last layers: its final send then carries no bytes). `ready` (a CUDA
        event; `device_pages` only): the layers are complete once it is, and so are those handed
        over before; the part is then laid out on the sender's own stream behind it and posted at
        once, whatever else is on the link, since the device orders it."""
        tx = self._sender()
        _check_live(ticket)
        if ticket.address != tx.address and tx.address is not None:
            raise ValueError(f"ticket of {ticket.req_id!r} names {ticket.address}, this connector sends to {tx.address}")
        if ready is not None and not self.device_pages:
            raise ValueError("a ready event needs the NCCL backend (device pages); gloo takes host pages as they are")
        tx.send_layers(ticket, layers, ready, last)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every p2p send completed or failed; True if none is left. Waits at most
        `timeout` s (default `timeout`); a send still pending then fails and drops the pairing,
        since its bytes may be half on the stream."""
        return self._sender().flush(self.config.timeout if timeout is None else timeout)

    def _sender(self) -> NcclSender:
        self._check_open()
        if self._tx is None:
            raise RuntimeError("this NcclConnector receives (rank 1); only the rank-0 connector sends")
        return self._tx

    # ------------------------------------------------------------------------------- receive

    def recv(self, timeout: float | None = None) -> StatePages | None:
        self._check_open()
        if self._rx is None:
            raise RuntimeError("this NcclConnector only sends: construct it with `bind` and `reservations`")
        return self._rx.recv(timeout)

    # ------------------------------------------------------------------------------- bookkeeping

    def get_finished(self) -> tuple[set[str], set[str]]:
        if self._tx is not None and not self._closed:
            self._tx.reap()
        return self.ledger.take_finished()

    def get_failed(self) -> dict[str, str]:
        return {req_id: f.reason for req_id, f in self.get_failures().items()}

    def get_failures(self) -> dict[str, TransferFailure]:
        """Receiver: a request whose sender aborted it (its abort message) is of kind SENDER_ABORTED."""
        if self._tx is not None and not self._closed:
            self._tx.reap()
        return self.ledger.take_failures()

    def get_stats(self) -> dict[str, TransferStats]:
        """Per-request TransferStats since the last call (sender: send() to p2p completed;
        receiver: metadata read to tensors checked)."""
        return self.ledger.take_stats()

    def abort(self, req_id: str) -> None:
        """Receiver: cancel the reservation; the request's bytes, if they come, are drained and
        dropped. Sender: tell the receiver to release its reservation (reported there as a failure
        of kind SENDER_ABORTED, "aborted by the sender"); a send already posted still completes
        (stream sync) and is delivered, but is not reported here."""
        self.ledger.abort(req_id)
        if self._tx is not None and not self._closed:
            self._tx.abort(req_id)
        if self.reservations is not None:
            self.reservations.cancel(req_id)

    def close(self) -> None:
        """Wait up to `send_timeout` for posted sends, then drop the group, sockets and store."""
        if self._closed:
            return
        self._closed = True
        if self._tx is not None:
            self._tx.close(self.config.send_timeout)
        if self._rx is not None:
            self._rx.close()
        self._ctx.term()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this NcclConnector is closed")


def _check_live(ticket: Ticket) -> None:
    """ValueError if the decode side has let the reservation go (`send` and `send_layers`)."""
    if ticket.expired():
        raise ValueError(f"the reservation of {ticket.req_id!r} expired {-ticket.remaining():.3f} s ago")
