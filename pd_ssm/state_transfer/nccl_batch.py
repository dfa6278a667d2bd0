"""OutBatch: the NCCL sender's coalesced data message -- several requests in ONE p2p message.

Why: the link moves a Mamba2-2.7B request in ~0.5 ms (fp32; bf16 ~0.25), and each message costs
the hosts a fixed ~0.3 ms a side (buffer allocation, block-sum kernel launch, p2p post, control
part, recv post) on top of ~0.15-0.2 ms per request (the copies into the buffer, request frame,
run headers). One request a message keeps the link waiting for the hosts; k requests a message
pay the fixed part once.

When (nccl_sender.py, nccl_coalesce.py): a request goes out at once when the link is idle (no added latency for a
lone request); one that comes while an earlier message is still on its way is held, and what is
held goes out as one message as soon as it reaches `NcclConfig.coalesce_bytes` or at the
sender's next call that is not a `send` (reap / flush / abort / close: a worker loop reaps once
a step, right after the step's sends). Holding costs nothing while the link is busy: the held
bytes could not move before the earlier message's anyway.

Guarantees per request, not per message: each request's runs carry their own checksums, so the
receiver verifies, hands out or fails each one alone (a corrupt request fails, its siblings
arrive); an abort names one request; a lost peer fails every request of every message in flight.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from pd_ssm.state_transfer.nccl_checksum import PendingSums
from pd_ssm.state_transfer.nccl_coalesce import Queued
from pd_ssm.state_transfer.nccl_control import Control
from pd_ssm.state_transfer.nccl_message import layout_many, seal_sums
from pd_ssm.state_transfer.wire import encode_request


class OutBatch:
    """One data message: its requests laid out in one buffer (queued on the device's current
    stream), then -- once the p2p send is posted -- its block sums queued; `parts` builds the
    side-channel message when they are on the host."""

    def __init__(self, queued: list[Queued], device: torch.device, gen: int) -> None:
        pages = [q.pages for q in queued]
        self.req_ids = [p.req_id for p in pages]
        self.starts = [q.start for q in queued]
        self.buf, self._metas, self.sizes = layout_many(pages, device)  # ValueError: a dtype off the wire
        self._frames = [encode_request(p.request) for p in pages]
        self.control = Control.data(gen, self.req_ids, self.sizes).encode()
        self.sums: PendingSums | None = None  # queued by `queue_sums`, after the p2p send is posted

    def queue_sums(self) -> None:
        """The block sums, behind the layout on the stream. NOTE: queued after the p2p post, so
        the send waits for the copies only (both kernels read the buffer: no hazard)."""
        self.sums = PendingSums(self.buf)

    def ready(self) -> bool:
        return self.sums is None or self.sums.ready()

    def parts(self, token: bytes) -> list[Any]:
        """[token, control, then per request: request header, request payload, runs] -- the run
        checksums filled in from the block sums (waits for them if they are not on the host)."""
        sums = self.sums.wait() if self.sums is not None else b""
        parts: list[Any] = [token, self.control]
        for metas, (header, payload) in zip(self._metas, self._frames, strict=True):
            seal_sums(metas, sums)
            parts += [header, payload, msgpack.packb(metas, use_bin_type=True)]
        return parts

