"""Inbound: one side-channel message the NCCL receiver has read -- for data, its p2p recv posted,
its requests parsed while their bytes are on the link, then acted on one request at a time.

A data message may carry several requests (coalesced by the sender, nccl_batch.py). What needs
no byte of the message -- each request frame and run-header list, checked -- is parsed once, as
soon as the recv is posted, so that after the last byte lands only the block sums of the whole
buffer (one pass; on NCCL already queued behind the recv) and, per request, a comparison of its
runs' sums with the sender's trailer and the views are left. Each request then
ends on its own: handed out, or failed with its own reason (a corrupt request does not take its
siblings with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pd_ssm.cache.pages import RequestState
from pd_ssm.state_transfer.nccl_checksum import PendingSums
from pd_ssm.state_transfer.nccl_control import PARTS_PER_REQUEST, Control
from pd_ssm.state_transfer.nccl_message import RunMeta
from pd_ssm.state_transfer.nccl_unpack import Headers, parse_request, parse_tensors
from pd_ssm.state_transfer.wire import FrameError

# a request's frame (None for a part) and runs, or why they are refused
Parsed = tuple[RequestState | None, list[RunMeta]] | str


@dataclass(slots=True)
class Inbound:
    msg: list[bytes]
    control: Control
    authentic: bool
    start: float  # time.monotonic() it was read
    buf: torch.Tensor | None = None  # where its p2p bytes land
    work: Any = None  # the posted recv, until it completed or failed
    lost: str | None = None  # why its bytes cannot come
    sums: PendingSums | None = None  # block sums of its requests' bytes, and the trailer (NCCL: queued behind the recv)
    parsed: list[Parsed] | None = None
    next: int = 0  # the next of its requests to act on

    @property
    def done(self) -> bool:
        """Every request of it acted on (a hello or an abort: itself)."""
        return self.next >= (len(self.control.req_ids) if self.control.kind == "data" else 1)

    def parse(self, memo: Headers | None = None) -> list[Parsed]:
        """Each request's frame and run headers, checked against its part of the buffer; once.
        `memo`: the receiver's memo of run headers checked (nccl_memo.py)."""
        if self.parsed is None:
            self.parsed = parse_requests(self.msg, self.control, memo)
        return self.parsed

    def is_part(self, i: int) -> bool:
        """Whether the i-th entry of this data message is a part (layers streamed ahead)."""
        start = 2 + PARTS_PER_REQUEST * i
        return len(self.msg) >= start + 2 and is_part(self.msg[start], self.msg[start + 1])

    def block_sums(self) -> tuple[bytes, bytes]:
        """(the block sums of the requests' bytes as received, the sender's from the trailer);
        computed here on the CPU, where nothing queued them."""
        assert self.buf is not None
        if self.sums is None:
            payload = self.control.nbytes
            self.sums = PendingSums(self.buf[:payload], self.buf[payload:])
        return self.sums.wait(), self.sums.theirs()


def is_part(header: bytes, payload: bytes) -> bool:
    """An entry without a request frame: a part (nccl_control.py)."""
    return len(header) == 0 and len(payload) == 0


def parse_requests(msg: list[bytes], control: Control, memo: Headers | None = None) -> list[Parsed]:
    """[token, control, then per request: header, payload, runs] -> one Parsed per request of
    `control`; the k-th request's runs must tile [sum(sizes[:k]), sum(sizes[:k + 1]))."""
    k = len(control.req_ids)
    want = 2 + PARTS_PER_REQUEST * k
    if len(msg) != want:
        return [f"a data message of {k} request(s) has {want} parts, this one {len(msg)}"] * k
    out: list[Parsed] = []
    offset = 0
    for i, (req_id, size) in enumerate(zip(control.req_ids, control.sizes, strict=True)):
        header, payload, runs = msg[2 + PARTS_PER_REQUEST * i : 2 + PARTS_PER_REQUEST * (i + 1)]
        try:
            if is_part(header, payload):  # layers ahead of the request's frame, which its last part brings
                if control.parts[i]:
                    raise FrameError(f"a part of {req_id!r} counts parts before it: only its last part does")
                request = None
            else:
                request = parse_request(header, payload, req_id)
            out.append((request, parse_tensors(runs, offset, offset + size, memo)))
        except FrameError as e:
            out.append(str(e))
        offset += size
    return out
