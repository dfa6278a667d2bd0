"""OutMessage: the NCCL sender's data message -- one request or several coalesced into ONE p2p
message, with the side-channel parts that describe it.

Why coalesce: the link moves a Mamba2-2.7B request in ~0.5 ms (fp32; bf16 ~0.25), and each
message costs the hosts a fixed ~0.3 ms a side (buffer allocation, block-sum kernel launch, p2p
post, control part, recv post) on top of ~0.15-0.2 ms per request (the copies into the buffer,
request frame, run headers). One request a message keeps the link waiting for the hosts; k
requests a message pay the fixed part once.

When (nccl_sender.py, nccl_coalesce.py): a request goes out at once when the link is idle (no
added latency for a lone request); one that comes while an earlier message is still on its way
is held, and what is held goes out as one message as soon as it reaches
`NcclConfig.coalesce_bytes` or at the sender's next call that is not a `send` (reap / flush /
abort / close: a worker loop reaps once a step, right after the step's sends; a `send_layers`
call that finds the link idle). Holding costs
little while the link is busy -- the held bytes could not move before the earlier message's anyway
-- as long as a message is small enough to be laid out while the one before it moves: a burst of
8 bf16 requests coalesced at 512 MB left the link idle ~1 ms while its 6-request second message
was copied and summed (nccl_timeline_gpu.py, RESULTS.md session 7).

Gated entries (`ready`, layer-wise streaming from device pages): the layout runs on the sender's
own stream behind their events, so the pages it reads are still being made when it is queued; the
pages belong to another stream's allocations, so the message keeps them (`keep`) until its send
completed, lest their memory be reused before the copy read it.

Guarantees per request, not per message: each request's runs are checked against their own
blocks of the sums trailer, so the receiver verifies, hands out or fails each one alone (a
corrupt request fails, its siblings arrive); an abort names one request; a lost peer fails every
request of every message in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pd_ssm.state_transfer.nccl_coalesce import Queued
from pd_ssm.state_transfer.nccl_control import Control
from pd_ssm.state_transfer.nccl_message import Layouts, Plan, fill, plan
from pd_ssm.state_transfer.wire import encode_request


@dataclass(slots=True)
class OutMessage:
    req_ids: list[str]
    sizes: list[int]  # each request's bytes in the buffer (the trailer after them)
    starts: list[float]  # time.monotonic() of each request's send: its TransferStats count from there
    parts: list[Any]  # the side-channel message; [] once sent
    buf: torch.Tensor | None = None  # laid out after the metadata went; kept until the p2p send completed
    plan: Plan | None = None  # what `lay_out` copies where
    work: Any = None  # the p2p send's torch.distributed Work, once posted (None: no bytes to send)
    finals: list[bool] | None = None  # per entry, whether it is its request's last part (None: all are)
    ready: list[Any] = field(default_factory=list)  # device events the entries' pages are complete after
    keep: Any = None  # with `ready`: the pages laid out, alive until the send completed (module docstring)
    priors: list[int] = field(default_factory=list)  # per entry, its request's bytes in earlier parts

    def lay_out(self, device: torch.device) -> torch.Tensor:
        """The buffer with its sums trailer (kernels queued on the current stream, not waited for)."""
        if self.buf is None:
            assert self.plan is not None
            if self.ready:
                self.keep = self.plan.sources
            self.buf, self.plan = fill(self.plan, device), None
        return self.buf


def build(queued: list[Queued], gen: int, token: bytes, layouts: Layouts | None = None) -> OutMessage:
    """The message's metadata -- [token, control, then per request: request header, request
    payload, runs] -- from the plan alone: it can leave before any byte is copied, so the receiver
    allocates and posts its recv while the sender lays the buffer out. ValueError for a tensor
    whose dtype cannot go on the wire. `layouts`: the sender's memo of run headers (nccl_memo.py)."""
    pages = [q.pages for q in queued]
    req_ids = [p.req_id for p in pages]
    planned = plan(pages, layouts)
    parts: list[Any] = [token, Control.data(gen, req_ids, planned.sizes, [q.parts for q in queued]).encode()]
    for q, runs in zip(queued, planned.packed, strict=True):
        # NOTE: a part (layer-wise streaming) has no request frame: its first token is not sampled yet
        parts += [b"", b"", runs] if q.part else [*encode_request(q.pages.request), runs]
    finals = [not q.part for q in queued]
    return OutMessage(req_ids, planned.sizes, [q.start for q in queued], parts, plan=planned,
                      finals=None if all(finals) else finals, ready=[q.ready for q in queued if q.ready is not None],
                      priors=[q.prior for q in queued])
