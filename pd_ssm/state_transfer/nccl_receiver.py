"""NcclReceiver: the decode side of the NCCL connector -- hosting the rendezvous, joining senders'
generations, receiving and checking requests against the ReservationTable.

See nccl_connector.py for the protocol. Every request of a data message read ends in exactly one
of: a StatePages returned, a failure in the ledger (reservation cancelled where the message was
authentic and named a live one), or a silent drop (aborted here); a hello changes the pairing, an
abort releases one reservation (a failure of kind SENDER_ABORTED: the sender reports its abort).
"""

from __future__ import annotations

import hmac
import time
from collections import deque

import torch
import torch.distributed as dist
import zmq

from pd_ssm.cache.pages import StatePages
from pd_ssm.state_transfer.base import FailureKind, TransferStats
from pd_ssm.state_transfer.ledger import TransferLedger
from pd_ssm.state_transfer.nccl_checksum import PendingSums, trailer_bytes
from pd_ssm.state_transfer.nccl_config import NcclConfig
from pd_ssm.state_transfer.nccl_control import Control, parse_control
from pd_ssm.state_transfer.nccl_group import (
    ADDRESS_KEY,
    GEN_KEY,
    POLL_S,
    RECEIVER_RANK,
    PeerGroup,
    dropped_key,
    host_store,
    split_tcp,
)
from pd_ssm.state_transfer.nccl_inbound import Inbound
from pd_ssm.state_transfer.nccl_memo import Memo
from pd_ssm.state_transfer.nccl_pinned import PinnedPool
from pd_ssm.state_transfer.nccl_streamed import StreamedParts
from pd_ssm.state_transfer.nccl_unpack import Headers, unpack_runs
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.wire import FrameError

# runs parts kept (each at most 64 KiB): a few models' layouts at every place a coalesced message puts a request
_MEMO_ENTRIES = 256
_MAX_FAILED_STREAMS = 1 << 16


class NcclReceiver:
    def __init__(
        self, config: NcclConfig, ledger: TransferLedger, ctx: zmq.Context, bind: str, table: ReservationTable
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.table = table
        self.device = torch.device(config.device)
        self.recv_device = torch.device(config.recv_device or config.device)
        self._token = config.token.encode()
        self._group: PeerGroup | None = None
        self._gen = 0  # the newest generation joined; data messages of older ones are stale
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(bind)  # "tcp://host:0": a free port; `address` says which
        self.address: str = pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pull = pull
        store = host_store(config.rendezvous, config.timeout)
        store.set(ADDRESS_KEY, self.address)
        self.rendezvous = f"tcp://{split_tcp(config.rendezvous)[0]}:{store.port}"
        self._store: dist.TCPStore | None = store
        self._headers: Headers = Memo(_MEMO_ENTRIES)  # runs parts checked: they repeat message after message
        self._queue: deque[Inbound] = deque()  # side-channel messages read, in order, not yet acted on
        # NCCL: block sums run here behind each recv, off the stream the decode engine computes on
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pinned = PinnedPool() if self._side is not None else None  # where those sums land on the host
        self._streamed = StreamedParts()  # layer-wise streaming: parts held until their request's last entry
        # streamed requests failed before their last entry: their later entries are dropped
        # silently (one failure per request); bounded, a dead sender's never come
        self._failed_streams: dict[str, None] = {}

    @property
    def paired(self) -> bool:
        return self._group is not None

    def recv(self, timeout: float | None) -> StatePages | None:
        end = None if timeout is None else time.monotonic() + timeout
        self._drop_orphans()
        while True:
            self._fill()
            if self._queue:
                head = self._queue[0]
                pages = self._finish(head, end)  # one request of it; stays queued meanwhile: lose_peer fails it too
                if head.done:
                    self._queue.popleft()
                if pages is not None:
                    return pages
            else:
                left = None if end is None else max(0.0, end - time.monotonic())
                if not self._pull.poll(None if left is None else int(left * 1000)):
                    return None
            if end is not None and time.monotonic() >= end:
                return None

    def _fill(self) -> None:
        """Read the side-channel messages already there, in order, and post each data message's
        p2p recv at once while fewer than `recv_window` bytes are posted: NCCL moves the next
        request while this one is checked, so the link does not idle between requests. A hello or
        abort ends the batch (it must act after the messages before it, and a hello changes the
        group that later recvs go on)."""
        while not self._queue or (self._queue[-1].control.kind == "data" and self._posted_bytes() < self.config.recv_window):
            if not self._pull.poll(0):
                return
            item = self._read(self._pull.recv_multipart())
            if item is not None:
                self._queue.append(item)

    @property
    def in_flight(self) -> int:
        """Data messages read whose recv is posted and not yet completed."""
        return sum(1 for i in self._queue if i.work is not None)

    def _posted_bytes(self) -> int:
        return sum(i.buf.numel() for i in self._queue if i.buf is not None and i.work is not None)

    def _read(self, msg: list[bytes]) -> Inbound | None:
        """Parse the control part; for a data message, post its recv (always, to keep the stream in
        sync). None for a message that is dealt with here (unparsable control part)."""
        authentic = hmac.compare_digest(msg[0], self._token)
        try:
            if len(msg) < 2:
                raise FrameError(f"a message of {len(msg)} parts has no control part")
            control = parse_control(msg[1])
        except FrameError as e:
            if authentic and self._group is not None:
                # our sender's data message we cannot size: its p2p bytes would misalign the stream
                self.lose_peer(f"unreadable control part: {e}")
            self.ledger.fail_anonymous("malformed", f"side-channel message dropped: {e}")
            return None
        item = Inbound(msg, control, authentic, time.monotonic())
        if control.kind != "data":
            return item
        if self._group is None or control.gen != self._group.gen:
            item.lost = f"sent on pairing generation {control.gen}, which is gone (its sender died or was replaced)"
            return item
        try:
            total = control.nbytes + trailer_bytes(control.nbytes)  # the sender's block sums after the requests
            if total > self.config.max_message_bytes:
                raise RuntimeError(f"{total} bytes exceed max_message_bytes {self.config.max_message_bytes}")
            item.buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        except RuntimeError as e:  # torch.OutOfMemoryError is one too
            # NOTE: bytes we cannot take would misalign the stream: the pairing goes (the sender
            # re-pairs); a forged message never gets to allocate more than the cap
            self.lose_peer(f"cannot take a {control.nbytes}-byte message: {e}")
            item.lost = f"its {control.nbytes} bytes could not be received here: {str(e).splitlines()[0][:200]}"
            return item
        if control.nbytes:
            try:
                item.work = self._group.irecv(item.buf)
            except RuntimeError as e:
                self._lost(item, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                return item
            if self._side is not None:
                item.sums = self._sums_behind_recv(item)
        return item

    def _sums_behind_recv(self, item: Inbound) -> PendingSums:
        """NCCL: the message's block sums queued on the side stream behind its recv (`Work.wait`
        makes the current stream wait, not the host), so they run as the last byte lands instead
        of after the host noticed and launched them; a recv that never completes (peer dead,
        communicator aborted) can stall only that stream."""
        assert self._side is not None and item.buf is not None
        payload = item.control.nbytes
        with torch.cuda.stream(self._side):
            item.work.wait()
            item.buf.record_stream(self._side)
            return PendingSums(item.buf[:payload], item.buf[payload:], self._pinned)

    def _finish(self, item: Inbound, until: float | None = None) -> StatePages | None:
        """The next message in order: act on it, or on the next of its requests -- waiting for its
        bytes (until `until` at most: then None, and it stays as it is), then checking that request."""
        control = item.control
        if control.kind != "data":
            item.next = 1
            if control.kind == "hello":
                self._hello(control, item.authentic)
            elif not item.authentic:  # an intruder must not cancel reservations
                self.ledger.fail_anonymous("unauthenticated", f"abort of {control.req_id!r} with a wrong token")
            elif control.req_id in self.table:  # otherwise it arrived or failed already: nothing to undo
                self._fail(control.req_id, "aborted by the sender", FailureKind.SENDER_ABORTED)
            self._streamed.drop(control.req_id)  # its parts came before the abort; nothing of it follows
            return None
        if item.work is not None:
            if item.authentic:
                item.parse(self._headers)  # while its bytes are on the link
            if not self._wait(item, until):
                return None
            self._fill()  # the next messages' recvs go on the link before this one is checked
        if not item.authentic:
            item.next = len(control.req_ids)  # all of it dropped at once
            self.ledger.fail_anonymous("unauthenticated", (
                f"request(s) {list(control.req_ids)!r:.200} with a wrong cluster token: {control.nbytes} bytes dropped"
            ))
            return None
        i = item.next
        item.next += 1
        req_id, size = control.req_ids[i], control.sizes[i]
        last = not item.is_part(i)  # its request's last entry (a part is followed by more)
        if req_id in self._failed_streams:  # failed at an earlier part (reported then)
            if last:
                del self._failed_streams[req_id]
            return None
        if self.ledger.is_aborted(req_id):
            self._streamed.drop(req_id)
            return None  # aborted here: dropped silently (the abort was the caller's own)
        ticket = self.table.get(req_id)
        if ticket is None:
            self._fail_stream(req_id, "no reservation for this request (unknown, completed or expired)", last)
            return None
        if item.lost is not None:
            self._fail_stream(req_id, item.lost, last)
            return None
        if ticket.expired(self.table.clock()):
            self._fail_stream(req_id, "its reservation expired before the pages arrived", last)
            return None
        parsed = item.parse(self._headers)[i]
        try:
            if isinstance(parsed, str):
                raise FrameError(parsed)
            request, metas = parsed
            assert item.buf is not None
            runs = unpack_runs(metas, item.buf, self.recv_device, item.block_sums())
            if request is None:  # a part: checked and held until the request's last entry
                self._streamed.add(req_id, runs, size, item.start)
                return None
            streamed = self._streamed.finish(req_id, control.parts[i], runs)
        except FrameError as e:
            self._fail_stream(req_id, f"bad metadata or bytes: {e}", last)
            return None
        pages = StatePages(request, runs=streamed.runs)
        self.table.complete(req_id)
        # NOTE: a streamed request counts from its first part, with every part's bytes
        start = item.start if streamed.start is None else streamed.start
        self.ledger.received(TransferStats(req_id, size + streamed.nbytes, time.monotonic() - start))
        return pages

    def _wait(self, item: Inbound, until: float | None = None) -> bool:
        """Until `item`'s recv completed (taking in and posting the next messages meanwhile, where
        the backend can be polled), or failed -- then the peer is lost -- or `timeout` after it was
        read: True. False if `until` came first (NCCL only, which can be polled): the recv stays
        posted. NOTE: a streamed part's metadata leaves when its layers are launched, its bytes
        once the sender's GPU made them (nccl_connector.py): a caller that polls must not block
        for a prefill's forward."""
        group, work = self._group, item.work
        assert group is not None and work is not None
        end = item.start + self.config.timeout
        stop = end if until is None else min(end, until)
        while group.done(work) is False and time.monotonic() < stop:
            self._fill()
            if item.work is None:  # the peer was lost meanwhile
                return True
            time.sleep(POLL_S)
        if item.work is None:
            return True
        if until is not None and time.monotonic() < end and group.done(work) is False:
            return False
        why = group.wait(work, max(0.0, end - time.monotonic()))
        item.work = None
        if why is not None:
            self.lose_peer(f"p2p recv failed: {why}")
            item.lost = f"peer lost mid-transfer ({item.control.nbytes} B): {why}"
        return True

    def _lost(self, item: Inbound, why: str) -> None:
        self.lose_peer(f"p2p recv failed: {why}")
        item.lost = f"peer lost mid-transfer ({item.control.nbytes} B): {why}"

    def _fail(self, req_id: str, reason: str, kind: FailureKind = FailureKind.ERROR) -> None:
        """The request's reservation is released and its failure reported (the caller frees its pages)."""
        self.table.cancel(req_id)
        self.ledger.fail(req_id, reason, kind)

    def _fail_stream(self, req_id: str, reason: str, last: bool) -> None:
        """`_fail`, and its parts held go; unless this was its `last` message, the ones still to
        come are dropped silently (the request failed once)."""
        self._fail(req_id, reason)
        self._streamed.drop(req_id)
        if not last:
            self._mark_failed(req_id)

    def _mark_failed(self, req_id: str) -> None:
        self._failed_streams[req_id] = None
        if len(self._failed_streams) > _MAX_FAILED_STREAMS:
            del self._failed_streams[next(iter(self._failed_streams))]

    def _drop_orphans(self) -> None:
        """Parts of requests whose reservation left the table (expired, or released by the caller)
        go now, with their buffers; the rest of such a request is dropped when it comes (the
        caller knows it failed: it released the reservation)."""
        for req_id in self._streamed.req_ids():
            if req_id not in self.table:
                self._streamed.drop(req_id)
                self._mark_failed(req_id)

    def _hello(self, control: Control, authentic: bool) -> None:
        if not authentic:
            self.ledger.fail_anonymous("unauthenticated", f"hello of generation {control.gen} with a wrong token")
            return
        assert self._store is not None
        if control.gen <= self._gen or control.gen < self._store.add(GEN_KEY, 0):
            return  # superseded: that sender gave up or a newer one already asked
        self.lose_peer(f"replaced by generation {control.gen}")
        self._gen = control.gen
        try:
            self._group = PeerGroup(self._store, control.gen, RECEIVER_RANK, self.device, self.config.timeout)
        except RuntimeError as e:
            self.ledger.fail_anonymous("pairing", f"generation {control.gen} did not pair: {e}")

    def lose_peer(self, reason: str) -> None:
        """Tear the group down and tell its sender through the store; the next hello pairs again.
        Every recv posted on it fails (its bytes may be half on the stream)."""
        for item in self._queue:
            if item.work is not None:
                item.work = None
                item.lost = f"peer lost mid-transfer ({item.control.nbytes} B): {reason}"
        for req_id in self._streamed.req_ids():  # their last entries cannot come on a new pairing
            self._streamed.drop(req_id)
            if not self.ledger.is_aborted(req_id):
                self._fail(req_id, f"peer lost between the parts of the request: {reason}")
            self._mark_failed(req_id)  # an entry of the old pairing read later: already failed
        if self._group is not None:
            if self._store is not None:
                self._store.set(dropped_key(self._group.gen), reason)
            self._group.close()
            self._group = None

    def close(self) -> None:
        self.lose_peer("receiver closed")
        self._pull.close()
        self._store = None
