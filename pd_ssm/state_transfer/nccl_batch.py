"""OutMessage: the NCCL sender's data message -- one request or several coalesced into ONE data
message (one buffer, one side-channel message), with the side-channel parts that describe it.

Why coalesce: the link moves a Mamba2-2.7B request in ~0.5 ms (fp32; bf16 ~0.25), and each
message costs the hosts a fixed ~0.3 ms a side (buffer allocation, block-sum kernel launch, p2p
post, control part, recv post) on top of ~0.15-0.2 ms per request (the copies into the buffer,
request frame, run headers). One request a message keeps the link waiting for the hosts; k
requests a message pay the fixed part once.

Coalescing is of the metadata and the per-message work (one side-channel message, one buffer,
one trailer, one copy of the sums to the receiver's host); the bytes still travel as one p2p op
per request (nccl_control.spans), laid out and summed one request at a time (nccl_layout.py), so
a large message does not wait for all of its copies before its first byte moves.

When (nccl_sender.py, nccl_coalesce.py): a request goes out at once when the link is idle (no
added latency for a lone request); one that comes while an earlier message is still on its way
is held, and what is held goes out as one message as soon as it reaches
`NcclConfig.coalesce_bytes` or at the sender's next call that is not a `send` (reap / flush /
abort / close: a worker loop reaps once a step, right after the step's sends). Holding costs
nothing while the link is busy: the held bytes could not move before the earlier message's anyway.

Guarantees per request, not per message: each request's runs are checked against their own
blocks of the sums trailer, so the receiver verifies, hands out or fails each one alone (a
corrupt request fails, its siblings arrive); an abort names one request; a lost peer fails every
request of every message in flight.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pd_ssm.state_transfer.nccl_coalesce import Queued
from pd_ssm.state_transfer.nccl_control import Control, spans
from pd_ssm.state_transfer.nccl_layout import Layout
from pd_ssm.state_transfer.nccl_message import Layouts, Plan, plan
from pd_ssm.state_transfer.wire import encode_request


@dataclass(slots=True)
class OutMessage:
    req_ids: list[str]
    sizes: list[int]  # each request's bytes in the buffer (the trailer after them)
    starts: list[float]  # time.monotonic() of each request's send: its TransferStats count from there
    parts: list[Any]  # the side-channel message; [] once sent
    buf: torch.Tensor | None = None  # laid out after the metadata went; kept until the p2p sends completed
    plan: Plan | None = None  # what `ops` lays out where
    groups: list[int] | None = None  # requests per p2p op (Control.ops); None: one each
    # the p2p sends' torch.distributed Works, once posted, in order ([]: no bytes to send)
    works: list[Any] = field(default_factory=list)

    def ops(self, device: torch.device) -> Iterator[torch.Tensor]:
        """The message's p2p ops in order (nccl_control.spans): laid out one op at a time
        from the plan (nccl_layout.py: each handed out once its bytes are queued; the caller posts
        its send before taking the next), or slices of a buffer given whole (`post`). Raises
        RuntimeError (out of device memory) before the first op."""
        if self.buf is None:
            assert self.plan is not None
            layout = Layout(self.plan, device, self.groups)
            self.buf, self.plan = layout.buf, None
            return layout.ops()
        buf = self.buf
        return iter([buf[start:end] for start, end in spans(self.sizes, self.groups)])


def build(
    queued: list[Queued], gen: int, token: bytes, layouts: Layouts | None = None, op_bytes: int = 1
) -> OutMessage:
    """The message's metadata -- [token, control, then per request: request header, request
    payload, runs] -- from the plan alone: it can leave before any byte is copied, so the receiver
    allocates and posts its recvs while the sender lays the buffer out. ValueError for a tensor
    whose dtype cannot go on the wire. `layouts`: the sender's memo of run headers (nccl_memo.py);
    `op_bytes`: NcclConfig.op_bytes (`op_groups`)."""
    pages = [q.pages for q in queued]
    req_ids = [p.req_id for p in pages]
    planned = plan(pages, layouts)
    ops = op_groups(planned.sizes, op_bytes)
    parts: list[Any] = [token, Control.data(gen, req_ids, planned.sizes, ops).encode()]
    for p, runs in zip(pages, planned.packed, strict=True):
        parts += [*encode_request(p.request), runs]
    return OutMessage(req_ids, planned.sizes, [q.start for q in queued], parts, plan=planned, groups=ops)


def op_groups(sizes: list[int], op_bytes: int) -> list[int]:
    """Requests per p2p op: consecutive requests share an op until it holds `op_bytes` (1: one
    request per op). A Mamba2-2.7B request (86-170 MB) is an op of its own at the default 16 MB."""
    groups: list[int] = []
    held = 0  # bytes of the last group
    for n in sizes:
        if groups and held < op_bytes:
            groups[-1] += 1
            held += n
        else:
            groups.append(1)
            held = n
    return groups
