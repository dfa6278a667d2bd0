"""Inbox: the receiving half of a frame connector -- messages in, checked StatePages out.

A request may arrive in several messages (layer-wise streaming: page frames as the sender's layers
finish, then a last message with the request and end frames). The inbox holds one PageAssembler
per request in progress and hands out a request only when its end frame arrived and every frame
checked out. Pure bookkeeping over the ReservationTable and the TransferLedger: no sockets.

Every message must name a request with a live Ticket. Any failure -- a bad frame, an expired or
missing reservation, the sender's "abort" frame -- drops what arrived of the request, cancels its
reservation and records the reason in the ledger (`get_failures`; the abort frame as kind
SENDER_ABORTED), so the caller frees the slot and blocks. A request whose pieces stopped coming is
dropped the same way once its ticket expires (`sweep`). Failures that name no request (wrong
token, unparsable header) are keyed "!<what>-<n>".
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from pd_ssm.cache.pages import StatePages
from pd_ssm.state_transfer.assembler import PageAssembler
from pd_ssm.state_transfer.base import FailureKind, TransferStats
from pd_ssm.state_transfer.checksum import gather_sums, sum_share, sum_shares
from pd_ssm.state_transfer.ledger import TransferLedger
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.wire import MAX_HEADER_BYTES, Buffer, Frame, FrameError, finish_frame, parse_frame
from pd_ssm.state_transfer.wire_fields import unpack


@dataclass(slots=True)
class _Partial:
    asm: PageAssembler
    start: float  # time.monotonic() of its first message
    nbytes: int  # bytes of its messages so far


class Inbox:
    def __init__(
        self,
        token: bytes,
        reservations: ReservationTable,
        ledger: TransferLedger,
        pool: Executor | None = None,
        threads: int = 1,
    ) -> None:
        self._token = token
        self._pool = pool  # sums a message's payloads in parallel (numpy drops the GIL)
        self._threads = threads  # the pool's workers
        self.reservations = reservations
        self.ledger = ledger
        self._partial: dict[str, _Partial] = {}  # NOTE: only requests whose ticket is in the table

    def accept(self, msg: Sequence[Buffer]) -> StatePages | None:
        """One message `[token, header, payload, ...]`; the request if this completed it, else None."""
        if not msg or not hmac.compare_digest(bytes(msg[0]), self._token):
            self.ledger.fail_anonymous("unauthenticated", f"message of {len(msg)} parts with a wrong cluster token dropped")
            return None
        parts = msg[1:]
        claim = _peek(parts[0]) if parts else None
        if claim is None:
            self.ledger.fail_anonymous("malformed", "message whose first frame names no request dropped")
            return None
        req_id, kind = claim
        if self.ledger.is_aborted(req_id):
            return None  # aborted here: its late pieces are dropped silently (abort already reported)
        table = self.reservations
        ticket = table.get(req_id)
        if ticket is None:
            self._partial.pop(req_id, None)
            if kind != "abort":  # a late abort of a request that is gone already says nothing new
                self.ledger.fail(req_id, "no reservation for this request (unknown, completed or expired)")
            return None
        if ticket.expired(table.clock()):
            self._drop(req_id, "its reservation expired before all its pages arrived")
            return None
        nbytes = sum(memoryview(p).nbytes for p in msg)
        part = self._partial.get(req_id)
        if part is None:
            part = self._partial[req_id] = _Partial(PageAssembler(req_id), time.monotonic(), 0)
        part.nbytes += nbytes
        try:
            if len(parts) % 2:
                raise FrameError(f"message of {req_id!r} has {len(parts)} frame parts, not [header, payload] pairs")
            for frame in self._decode(parts):
                if frame.kind == "abort" and frame.req_id == req_id:
                    assert frame.body is not None
                    self._drop(req_id, f"aborted by the sender: {frame.body['reason']}", FailureKind.SENDER_ABORTED)
                    return None
                part.asm.add(frame)
        except FrameError as e:
            self._drop(req_id, f"bad frame: {e}")
            return None
        if not part.asm.done:
            return None
        del self._partial[req_id]
        table.complete(req_id)
        self.ledger.received(TransferStats(req_id, part.nbytes, time.monotonic() - part.start))
        return part.asm.result()

    def _decode(self, parts: Sequence[Buffer]) -> list[Frame]:
        """[header, payload] pairs -> Frames; tensors view the received buffers (no copy).

        Every header is parsed here; the checksums' sums go to the pool in about equal shares of
        bytes (checksum.sum_shares), one task per thread -- a 32 MB run frame is summed by every
        thread, not by one -- and each frame is verified from its pieces' sums."""
        parsed = [parse_frame(h, p) for h, p in zip(parts[0::2], parts[1::2], strict=True)]
        payloads = [p.payload for p in parsed]
        shares = sum_shares([v.nbytes for v in payloads], self._threads)
        if self._pool is None or len(shares) < 2:
            results = [sum_share(payloads, share) for share in shares]
        else:
            results = list(self._pool.map(sum_share, [payloads] * len(shares), shares))
        sums = gather_sums(len(parsed), shares, results)
        return [finish_frame(p, s, copy=False) for p, s in zip(parsed, sums, strict=True)]

    def sweep(self) -> None:
        """Drop requests in progress whose reservation expired (failed: the caller frees it) or
        left the table (the caller expired or cancelled it, so it knows already)."""
        table = self.reservations
        now = table.clock()
        for req_id in list(self._partial):
            ticket = table.get(req_id)
            if ticket is None:
                del self._partial[req_id]
            elif ticket.expired(now):
                layers = self._partial[req_id].asm.arrived_layers()
                self._drop(req_id, f"its reservation expired with only layers {layers} arrived")

    def abort(self, req_id: str) -> None:
        self._partial.pop(req_id, None)
        self.reservations.cancel(req_id)

    def clear(self) -> None:
        self._partial.clear()

    @property
    def num_in_progress(self) -> int:
        return len(self._partial)

    def _drop(self, req_id: str, reason: str, kind: FailureKind = FailureKind.ERROR) -> None:
        self._partial.pop(req_id, None)
        self.reservations.cancel(req_id)
        self.ledger.fail(req_id, reason, kind)


def _peek(header: Buffer) -> tuple[str, str] | None:
    """(req_id, kind) a header claims, to attribute a failure; the full check is decode_frame's."""
    try:
        h = unpack(header, MAX_HEADER_BYTES, "frame header")
    except FrameError:
        return None
    if not isinstance(h, dict):
        return None
    req_id, kind = h.get("req_id"), h.get("kind")
    return (req_id, kind) if isinstance(req_id, str) and isinstance(kind, str) else None

