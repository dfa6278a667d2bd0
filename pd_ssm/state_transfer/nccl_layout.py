"""Layout: the NCCL sender's p2p buffer of one data message, laid out ONE OP AT A TIME (an op: one
request, or a few small ones, nccl_control.spans) and handed out op by op, so request i is on the
link while request i + 1 is copied into place and summed.

Why op by op: laid out whole, a message's buffer (up to 512 MB of coalesced requests) was
copied into place and block-summed before its one p2p send could start -- ~0.3 ms of device work
per 600 MB, serial with the link, which moves a bf16 Mamba2-2.7B request (86 MB) in ~0.29 ms. Now
the send of request i is posted right after request i's copies are queued, and its block sums are
queued after that post: they run on the compute stream while NCCL's stream moves the bytes, and
request i + 1's copies follow them. Only the first request's copy and the last request's sums
(the trailer travels in the last op) stay serial with the link.

Why still a copy (not a zero-copy send from the pages' own tensors): the wire needs each run at
a BLOCK-aligned offset with zeroed gaps and a request's part contiguous, so that one op carries a
request and the block sums line up with the runs. Zero-copy would take one op per run (a
request's runs are separate tensors), the runs' sizes in the control part (the receiver cuts the
stream by the control part alone, nccl_control.spans) and sums over partial blocks on both sides:
a wire change to save, once the copies are pipelined, only the first request's copy (~50 us for
86 MB on the H200) and one batched launch of host time per op.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pd_ssm.cache.pages import StatePages
from pd_ssm.state_transfer.nccl_checksum import BLOCK, align, trailer_bytes, write_sums
from pd_ssm.state_transfer.nccl_message import Plan, RunMeta, Source, plan


class Layout:
    """A message's buffer [the requests' parts | sums trailer] on `device`, filled by `ops`;
    `groups`: requests per p2p op (Control.ops; None: one each)."""

    def __init__(self, planned: Plan, device: torch.device, groups: list[int] | None = None) -> None:
        payload = planned.payload
        self.planned = planned
        self.groups = [1] * len(planned.sizes) if groups is None else groups
        if sum(self.groups) != len(planned.sizes) or min(self.groups, default=1) < 1:
            raise ValueError(f"op groups {self.groups} do not cover the message's {len(planned.sizes)} requests")
        # NOTE: raises (RuntimeError, OOM included) before any op is handed out
        self.buf = torch.empty(payload + trailer_bytes(payload), dtype=torch.uint8, device=device)

    def ops(self) -> Iterator[torch.Tensor]:
        """Each p2p op's slice of the buffer, in order (nccl_control.spans of the plan's sizes),
        handed out as soon as its bytes are queued (nothing waited for; on the CPU written at
        once). The caller posts each op's send before taking the next: request i's sums are
        queued after that post, so they overlap its transfer. After the last op, the buffer is
        whole, trailer included."""
        planned, buf = self.planned, self.buf
        payload = planned.payload
        trailer = buf[payload:]
        host = buf.numpy() if buf.device.type == "cpu" else None
        _zero_gaps(buf, host, planned.headers, payload)
        start = first = 0
        for k in self.groups:
            reqs = range(first, first + k)
            first += k
            _copy_runs(buf, [m for i in reqs for m in planned.headers[i]], [s for i in reqs for s in planned.sources[i]])
            end = start + sum(planned.sizes[i] for i in reqs)
            if end == start:
                continue
            part, sums = buf[start:end], trailer[start // BLOCK * 8 : end // BLOCK * 8]
            if end == payload:  # the last op with bytes: the trailer travels with it, its sums first
                write_sums(part, sums)
                yield buf[start:]
            else:
                yield part
                write_sums(part, sums)  # NOTE: after the caller posted the send: overlaps it
            start = end


def fill(planned: Plan, device: torch.device) -> torch.Tensor:
    """The planned buffer on `device` with its sums trailer, whole (all queued on the current
    stream, nothing waited for)."""
    layout = Layout(planned, device)
    for _ in layout.ops():
        pass
    return layout.buf


def pack(pages: StatePages, device: torch.device) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """One request's tensors in one uint8 buffer on `device`, sums trailer included, and its run
    headers (`layout_many` of one)."""
    buf, metas, _ = layout_many([pages], device)
    return buf, metas[0]


def layout_many(
    pages: list[StatePages], device: torch.device
) -> tuple[torch.Tensor, list[list[dict[str, Any]]], list[int]]:
    """Every request's tensors in ONE uint8 buffer on `device` (`plan` then `fill`); per request
    the header of each run (offsets into the whole buffer) and its size in the buffer."""
    planned = plan(pages)
    return fill(planned, device), planned.metas, planned.sizes


def _zero_gaps(buf: torch.Tensor, host: np.ndarray | None, headers: list[tuple[RunMeta, ...]], payload: int) -> None:
    """Zeros in the padding behind every run of the message (summed: both sides must see zeros)
    and behind the trailer's sums (unchecked, but no stale device memory goes on the wire), one
    batched launch for all of them on the device. `host`: the buffer's numpy view on the CPU,
    where a small fill through torch costs milliseconds on a busy machine (its thread pool wakes up
    for 64 KiB) and numpy's memset does not."""
    gaps: list[torch.Tensor] = []
    pads = [(m.offset + m.nbytes, align(m.offset + m.nbytes)) for metas in headers for m in metas]
    pads.append((payload + payload // BLOCK * 8, buf.numel()))
    for start, end in pads:
        if end > start:
            if host is not None:
                host[start:end] = 0
            else:
                gaps.append(buf[start:end])
    if gaps:
        torch._foreach_zero_(gaps)


def _copy_runs(buf: torch.Tensor, metas: list[RunMeta], sources: list[Source]) -> None:
    """An op's runs into their places in `buf`: stacked runs on the buffer's device in ONE
    batched copy (a copy_ launch per run cost the sender's host ~0.13 ms a request on the H200);
    across devices or as per-layer lists, one copy or stack per run (the slow path).

    Tensors of the same name and shape over the layers form a run, stacked by ONE kernel straight
    into its place: per-tensor work in Python (128 tensors for Mamba2-2.7B) would cost
    milliseconds a request, more than moving its 168 MB over NVLink."""
    outs: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for m, source in zip(metas, sources, strict=True):
        if not m.nbytes:
            continue
        out = buf[m.offset : m.offset + m.nbytes].view(m.dtype).view(len(m.layers), *m.shape)
        if isinstance(source, torch.Tensor) and source.device == buf.device:
            outs.append(out)
            srcs.append(source)
        elif isinstance(source, torch.Tensor):
            out.copy_(source)  # across devices: not batched
        else:
            if source[0].device != buf.device:  # host pages for a GPU buffer: the slow path
                source = [t.to(buf.device) for t in source]
            torch.stack(source, out=out)  # pages hold no autograd history (exported under no_grad)
    if outs:
        torch._foreach_copy_(outs, srcs)
