"""NcclSender: the prefill side of the NCCL connector -- pairing, posting requests, completing them.

See nccl_connector.py for the protocol. A sender is paired with exactly one receiver at a time;
after its peer is lost it fails what was in flight, holds no buffer, and re-pairs on the next
`send` (or an explicit `pair`).

`send` never waits for the device: it queues the pack kernels and the block sums, posts the p2p
send at once (NCCL orders it after the pack on the stream; the receiver's recv may come later) and
leaves the request "sealing". Its metadata -- which needs the sums on the host for the checksums
-- goes out once they are there, in posting order (every `send`, `reap` and `flush` pushes out
what is ready), so the host packs the next request while the device packs and the link carries
the previous ones. The side channel and the p2p stream carry requests in the same order; a
metadata message the receiver does not take within `send_timeout` therefore breaks the stream:
the pairing is dropped, failing what was in flight.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist
import zmq

from pd_ssm.cache.pages import StatePages
from pd_ssm.state_transfer.base import Ticket, TransferStats
from pd_ssm.state_transfer.ledger import TransferLedger
from pd_ssm.state_transfer.nccl_checksum import PendingSums
from pd_ssm.state_transfer.nccl_config import NcclConfig
from pd_ssm.state_transfer.nccl_group import (
    ADDRESS_KEY,
    GEN_KEY,
    SENDER_RANK,
    PeerGroup,
    dropped_key,
    join_store,
    split_tcp,
)
from pd_ssm.state_transfer.nccl_message import Control, layout, seal_sums
from pd_ssm.state_transfer.wire import encode_request

_PROBE_TIMEOUT = 1.0  # seconds a liveness probe of the rendezvous store may take
_REAP_PROBE_S = 0.02  # seconds between the store probes of `reap` (flush always probes)


@dataclass(slots=True)
class _Outgoing:
    req_id: str
    work: Any  # torch.distributed Work of the p2p send
    buf: torch.Tensor  # kept alive until the send completed
    start: float  # time.monotonic()


@dataclass(slots=True)
class _Sealing:
    """A request whose p2p send is posted and whose metadata waits for its block sums."""

    req_id: str
    parts: list[bytes | memoryview]  # [token, control, request header, request payload]; the runs part last
    metas: list[dict[str, Any]]
    sums: PendingSums
    empty_since: float | None  # a request with no bytes: sent once its metadata is out (its start)


class NcclSender:
    def __init__(self, config: NcclConfig, ledger: TransferLedger, ctx: zmq.Context) -> None:
        self.config = config
        self.ledger = ledger
        self.device = torch.device(config.device)
        self.rendezvous = config.rendezvous
        self.address: str | None = None  # the paired receiver's data address
        self._token = config.token.encode()
        self._ctx = ctx
        self._push: zmq.Socket | None = None
        self._group: PeerGroup | None = None
        self._probe: dist.TCPStore | None = None  # the receiver's store, with a short timeout
        self._pending: list[_Outgoing] = []  # FIFO: p2p sends complete in posting order
        self._sealing: deque[_Sealing] = deque()  # posted, metadata not sent yet; FIFO
        self._probed = 0.0  # time.monotonic() of reap's last store probe

    @property
    def paired(self) -> bool:
        return self._group is not None

    @property
    def in_flight(self) -> int:
        """p2p sends posted and not yet completed (each holds its buffer)."""
        return len(self._pending)

    def pair(self, rendezvous: str | None = None) -> None:
        if rendezvous is not None:
            split_tcp(rendezvous)
            self.rendezvous = rendezvous
        self.lose_peer("re-pairing")
        try:
            store = join_store(self.rendezvous, self.config.timeout)
            address = store.get(ADDRESS_KEY).decode()
            gen = store.add(GEN_KEY, 1)
            self._close_push()
            self._push = self._socket(address)
            try:
                self._push.send_multipart([self._token, Control("hello", gen, "", 0).encode()])
            except zmq.Again:
                raise RuntimeError(f"receiver {address} did not take the hello within {self.config.send_timeout} s") from None
            group = PeerGroup(store, gen, SENDER_RANK, self.device, self.config.timeout)
            # NOTE: a store client retries a lost server until its timeout: probes must not stall a dead peer's sender
            probe = join_store(self.rendezvous, min(_PROBE_TIMEOUT, self.config.timeout))
        except (RuntimeError, ValueError) as e:  # c10d raises RuntimeError (DistStoreError) on timeouts
            raise RuntimeError(f"pairing with the receiver at {self.rendezvous} failed: {e}") from e
        self.address, self._group, self._probe = address, group, probe

    def send(self, pages: StatePages, ticket: Ticket) -> None:
        if self._group is None:
            try:
                self.pair()
            except RuntimeError as e:
                self.ledger.fail(pages.req_id, str(e))
                return
        if ticket.address != self.address:
            raise ValueError(
                f"ticket of {ticket.req_id!r} names {ticket.address}, but this connector is paired with "
                f"the receiver at {self.address}: one NcclConnector per receiver"
            )
        start = time.monotonic()
        buf, metas = layout(pages, self.device)
        sums = PendingSums(buf)
        req_header, req_payload = encode_request(pages.request)
        assert self._group is not None
        control = Control("data", self._group.gen, pages.req_id, buf.numel()).encode()
        if buf.numel() and not self._isend(pages.req_id, buf, start):
            return
        parts: list[bytes | memoryview] = [self._token, control, req_header, req_payload]
        self._sealing.append(_Sealing(pages.req_id, parts, metas, sums, None if buf.numel() else start))
        self._seal(wait=False)

    def _seal(self, wait: bool) -> None:
        """Send the metadata of every sealing request whose sums are on the host, in order (all of
        them with `wait`). A refused one breaks the stream (its bytes are posted): peer lost."""
        while self._sealing and self._push is not None:
            head = self._sealing[0]
            if not wait and not head.sums.ready():
                return
            seal_sums(head.metas, head.sums.wait())
            self._sealing.popleft()
            try:
                self._push.send_multipart([*head.parts, msgpack.packb(head.metas, use_bin_type=True)])
            except zmq.Again:
                why = f"peer {self.address} did not take the metadata within {self.config.send_timeout} s"
                self.ledger.fail(head.req_id, why)
                self.lose_peer(why)
                return
            if head.empty_since is not None:
                self.ledger.sent(TransferStats(head.req_id, 0, time.monotonic() - head.empty_since))

    def _isend(self, req_id: str, buf: torch.Tensor, start: float) -> bool:
        assert self._group is not None
        try:
            work = self._group.isend(buf)
        except RuntimeError as e:  # gloo refuses at once on a pair whose peer is gone
            self.ledger.fail(req_id, f"peer lost: {e}")
            self.lose_peer(f"peer lost: {e}")
            return False
        self._pending.append(_Outgoing(req_id, work, buf, start))
        return True

    def post(self, req_id: str, parts: list[bytes | memoryview], buf: torch.Tensor, start: float) -> None:
        """Metadata parts out, then the p2p send of `buf` (none for an empty request). Public so
        fault tests can post a message they mangled; `send` is the way to post a request."""
        if self._push is None or self._group is None:
            raise RuntimeError("this NcclConnector is not paired: call pair() first")
        try:
            self._push.send_multipart(parts)
        except zmq.Again:
            self.ledger.fail(req_id, f"peer {self.address} did not take the metadata within {self.config.send_timeout} s")
            return
        if buf.numel() == 0:
            self.ledger.sent(TransferStats(req_id, 0, time.monotonic() - start))
            return
        try:
            work = self._group.isend(buf)
        except RuntimeError as e:  # gloo refuses at once on a pair whose peer is gone
            self.ledger.fail(req_id, f"peer lost: {e}")
            self.lose_peer(f"peer lost: {e}")
            return
        self._pending.append(_Outgoing(req_id, work, buf, start))

    def abort(self, req_id: str) -> None:
        """Tell the receiver to release the reservation of `req_id` now rather than at its expiry.
        Best effort: a send already posted has its bytes on the stream regardless, and its metadata
        goes out first (waiting for its sums, if it is still sealing) so the receiver reads them in
        order; the abort itself never blocks."""
        if self._push is None or self._group is None:
            return
        self._seal(wait=True)  # its metadata first, if it is still sealing: the side channel keeps order
        if self._push is None or self._group is None:
            return
        try:
            self._push.send_multipart([self._token, Control("abort", self._group.gen, req_id, 0).encode()], zmq.NOBLOCK)
        except zmq.Again:
            pass  # the receiver's expiry frees the reservation instead

    def flush(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        self._seal(wait=True)  # the receiver posts a recv only once it has the metadata
        # NOTE: probe first: a gloo send whose receiver died before posting its recv is never
        # failed by gloo, and a gloo wait cannot be sliced (a timed-out wait ends the Work)
        self._check_dropped()
        while self._pending and self._group is not None:
            out = self._pending[0]
            why = self._group.wait(out.work, end - time.monotonic())
            if why is not None:
                self.lose_peer(f"p2p send failed: {why}")
                break
            self._complete()
        self._check_dropped()  # and after: the receiver may have dropped what it just read
        return not self._pending

    def reap(self) -> None:
        """Report completed sends without blocking where the backend can tell (NCCL); a send older
        than `timeout` means the peer is gone. Also notices a pairing the receiver dropped (a store
        round trip, ~0.1-0.2 ms: at most every _REAP_PROBE_S, since a worker loop reaps each turn)."""
        self._seal(wait=False)
        now = time.monotonic()
        if now - self._probed >= _REAP_PROBE_S:
            self._probed = now
            self._check_dropped()
        while self._pending and self._group is not None:
            out = self._pending[0]
            if not self._group.done(out.work):
                if time.monotonic() - out.start > self.config.timeout:
                    self.lose_peer(f"p2p send not completed within {self.config.timeout} s")
                return
            why = self._group.wait(out.work, self.config.timeout)  # completed: surfaces its error
            if why is not None:
                self.lose_peer(f"p2p send failed: {why}")
                return
            self._complete()

    def _check_dropped(self) -> None:
        """One store round trip: did the receiver drop our generation (then re-pair on next send)?"""
        if self._group is None or self._probe is None:
            return
        key = dropped_key(self._group.gen)
        try:
            dropped = self._probe.check([key])
            reason = self._probe.get(key).decode() if dropped else ""
        except RuntimeError as e:  # the store went with its receiver
            dropped, reason = True, f"rendezvous store unreachable: {e}"
        if dropped:
            self.lose_peer(f"the receiver dropped the pairing ({reason})")

    def _complete(self) -> None:
        out = self._pending.pop(0)
        self.ledger.sent(TransferStats(out.req_id, out.buf.numel(), time.monotonic() - out.start))

    def lose_peer(self, reason: str) -> None:
        """Fail every send in flight (aborted ones silently) and tear the group down; the peer's
        pending ops then fail too, so it notices at once."""
        for out in self._pending:
            if not self.ledger.is_aborted(out.req_id):
                self.ledger.fail(out.req_id, reason)
        self._pending.clear()
        self._sealing.clear()  # each had its p2p send in _pending: failed above
        if self._group is not None:
            self._group.close()
            self._group = None
        self._probe = None

    def close(self, timeout: float) -> None:
        """Wait up to `timeout` for posted sends, then drop the group and the socket."""
        if self._group is not None:
            self.flush(timeout)
        self.lose_peer("connector closed")
        self._close_push()

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDTIMEO, int(self.config.send_timeout * 1000))
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # only onto a live connection: a dead peer -> Again
        sock.connect(address)
        return sock

    def _close_push(self) -> None:
        if self._push is not None:
            self._push.close()
            self._push = None
