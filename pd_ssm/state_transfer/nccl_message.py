"""The NCCL connector's p2p data message as the sender lays it out: the run headers (`RunMeta`)
that say where each run of a request's tensors sits in one uint8 buffer, planned and filled here
(the receiver's parsing and checks are nccl_unpack.py, the side-channel control part nccl_control.py).

p2p: ONE uint8 buffer per data message: its requests' bytes back to back (each request's part a
whole number of blocks, `Control.sizes`), then the trailer of the sender's block sums of all of
them (nccl_checksum.py). A run is the tensors of one name and shape over the layers that have it
(e.g. every SSM layer's "ssm" state), stacked in layer order; every run starts at a BLOCK-aligned
offset and the gaps are zero-filled, so the receiver hands out per-layer views of the buffer, no
copy, and checks each run's blocks against the trailer. A run header's "checksum" is the crc32 of
the header's own fields (`_describe`): a header edited in transit or by a buggy sender fails too.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from pd_ssm.cache.pages import StatePages
from pd_ssm.state_transfer.nccl_checksum import align, trailer_bytes, write_sums
from pd_ssm.state_transfer.nccl_memo import Memo
from pd_ssm.state_transfer.wire import DTYPES

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_RUN_KEYS = frozenset({"layers", "page_kind", "name", "dtype", "shape", "offset", "nbytes", "checksum"})


@dataclass(frozen=True, slots=True)
class RunMeta:
    """One run's place in the coalesced buffer: the same-named tensors of `layers`, stacked."""

    layers: tuple[int, ...]  # in the order they are stacked
    page_kind: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # of ONE layer's tensor
    offset: int  # BLOCK-aligned
    nbytes: int  # len(layers) x one tensor's bytes
    checksum: int  # crc32 of the header fields (`_describe`)


_Source = torch.Tensor | list[torch.Tensor]  # a run's tensors: stacked (or one strided view), or one per layer
_RunKey = tuple[str, str, torch.dtype, torch.Size]  # page kind, name, dtype, one layer's shape
# sender memo: (offset, per run (key, layers)) -> the request's run headers, packed, and its end
Layouts = Memo[tuple[tuple[RunMeta, ...], bytes, int]]


def _runs(pages: StatePages) -> list[tuple[_RunKey, tuple[int, ...], _Source]]:
    """The pages' tensors grouped by (page kind, name, dtype, shape), layers ascending, in order of
    first appearance: a Mamba2 request is 2 runs (conv, ssm), a hybrid 4 (+ k, v). Pages that
    still come as runs (export_pages) are taken as they are; per-layer pages are grouped here, a
    loop over every tensor (128 for a 2.7B request), kept lean."""
    if pages.runs is not None:
        return [((r.kind, r.name, r.stacked.dtype, r.stacked.shape[1:]), tuple(r.layers), r.stacked)
                for r in pages.runs]
    # NOTE: grouped by (kind, name) first; one pass over a group then checks dtype and shape and
    # whether it is one strided view (`_as_one`): a key of all four cost ~0.15 us more a tensor
    named: dict[tuple[str, str], tuple[list[int], list[torch.Tensor]]] = {}
    layers = pages.layers
    for layer_idx in sorted(layers):
        page = layers[layer_idx]
        kind = page.kind
        for name, t in page.tensors.items():  # NOTE: names in the order they were made (conv/ssm, k/v)
            group = named.get((kind, name))
            if group is None:
                group = named[(kind, name)] = ([], [])
            group[0].append(layer_idx)
            group[1].append(t)
    runs: list[tuple[_RunKey, tuple[int, ...], _Source]] = []
    for (kind, name), (ids, tensors) in named.items():
        first = tensors[0]
        source = _as_one(tensors)
        if source is not None:
            runs.append(((kind, name, first.dtype, first.shape), tuple(ids), source))
            continue
        split: dict[_RunKey, tuple[list[int], list[torch.Tensor]]] = {}  # not one view: by dtype and shape
        for layer_idx, t in zip(ids, tensors, strict=True):
            run = split.setdefault((kind, name, t.dtype, t.shape), ([], []))
            run[0].append(layer_idx)
            run[1].append(t)
        for key, (i, ts) in split.items():
            runs.append((key, tuple(i), ts[0].unsqueeze(0) if len(ts) == 1 else ts))
    return runs


def _as_one(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """A group's per-layer tensors as ONE [layers, ...] view when they have one dtype and shape and
    are evenly spaced contiguous slices of one allocation -- the per-layer views of a stacked
    tensor, as `layers_of` hands them out of export_pages' runs -- so the batched copy of `fill`
    takes the run instead of a stack (a launch and ~20-40 us of host time for 64 tensors). None
    otherwise: the caller groups them by dtype and shape, to be stacked."""
    first = tensors[0]
    if len(tensors) == 1:
        return first.unsqueeze(0)
    dtype, shape = first.dtype, first.shape
    base, step = first.data_ptr(), tensors[1].data_ptr() - first.data_ptr()
    size = first.element_size()
    # NOTE: the last one in the first one's allocation and every start at base + i * step (step
    # past a tensor's bytes) put every tensor inside that allocation, none overlapping
    if (step < first.nbytes or step % size
            or tensors[-1].untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
        return None
    at = base
    for t in tensors:
        if t.data_ptr() != at or t.dtype != dtype or t.shape != shape or not t.is_contiguous():
            return None
        at += step
    return first.as_strided((len(tensors), *shape), (step // size, *first.stride()))


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


class Plan(NamedTuple):
    """Where every request's runs go in a message's buffer, before any byte is copied."""

    headers: list[tuple[RunMeta, ...]]  # per request, its runs' headers (offsets into the whole buffer)
    packed: list[bytes]  # per request, its runs part: the msgpack list of its headers (`metas`)
    sizes: list[int]  # per request, its bytes in the buffer (a BLOCK multiple)
    sources: list[list[_Source]]  # per request, per run: what is copied there
    payload: int  # the requests' bytes; the sums trailer follows

    @property
    def metas(self) -> list[list[dict[str, Any]]]:
        """Per request, its run headers as they go on the wire (fresh dicts: a test may edit them)."""
        return [[_as_dict(m) for m in ms] for ms in self.headers]


def plan(pages: list[StatePages], memo: Layouts | None = None) -> Plan:
    """The requests back to back, each run at a BLOCK-aligned offset, headers complete (their own
    crc32 included) and packed: all the metadata, without touching a tensor's bytes. ValueError
    for a dtype that cannot go on the wire. `memo`: the sender's, where a request laid out as one
    before it at the same offset takes that one's headers (nccl_memo.py)."""
    headers, packed, sizes, sources = [], [], [], []
    offset = 0
    for p in pages:
        runs = _runs(p)
        key = (offset, tuple((k, layers) for k, layers, _ in runs))
        placed = None if memo is None else memo.get(key)
        if placed is None:
            placed = _plan(runs, offset)
            if memo is not None:
                memo.put(key, placed)
        headers.append(placed[0])
        packed.append(placed[1])
        sizes.append(placed[2] - offset)
        sources.append([source for _, _, source in runs])
        offset = placed[2]
    return Plan(headers, packed, sizes, sources, offset)


def fill(planned: Plan, device: torch.device) -> torch.Tensor:
    """The planned buffer on `device`, then the trailer of its block sums (all queued on the
    current stream, nothing waited for).

    Tensors of the same name and shape over the layers form a run, stacked by ONE kernel straight
    into its place in the buffer: per-tensor work in Python (128 tensors for Mamba2-2.7B) would
    cost milliseconds a request, more than moving its 168 MB over NVLink. The buffer is the only
    staging the NCCL path does (one p2p message is ~3x faster than one per tensor, TARGETS.md)."""
    payload = planned.payload
    buf = torch.empty(payload + trailer_bytes(payload), dtype=torch.uint8, device=device)
    host = buf.numpy() if buf.device.type == "cpu" else None
    outs: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    gaps: list[torch.Tensor] = []
    for ms, sources in zip(planned.headers, planned.sources, strict=True):
        _place(buf, host, ms, sources, outs, srcs, gaps)
    # NOTE: one batched copy and one batched zero for the whole message: per run, a copy_ and a
    # zero_ launch cost the sender's host ~0.13 ms a request on the H200, where the link moves a
    # bf16 2.7B request in ~0.29 ms and the next message waits for them
    if outs:
        torch._foreach_copy_(outs, srcs)
    if gaps:
        torch._foreach_zero_(gaps)
    write_sums(buf[:payload], buf[payload:])
    return buf


def _plan(runs: list[tuple[_RunKey, tuple[int, ...], _Source]], offset: int) -> tuple[tuple[RunMeta, ...], bytes, int]:
    """The headers of `runs` placed from `offset` on, packed as the runs part, and where they end."""
    metas: list[RunMeta] = []
    for (kind, name, dt, shape), layers, _ in runs:
        dtype = _DTYPE_NAMES.get(dt)
        if dtype is None:
            raise ValueError(f"dtype {dt} cannot go on the wire; allowed: {sorted(DTYPES)}")
        n = len(layers) * math.prod(shape) * dt.itemsize
        checksum = zlib.crc32(_describe(layers, kind, name, dtype, shape, offset, n))
        metas.append(RunMeta(layers, kind, name, dt, tuple(shape), offset, n, checksum))
        offset += align(n)
    return tuple(metas), msgpack.packb([_as_dict(m) for m in metas], use_bin_type=True), offset


def _as_dict(m: RunMeta) -> dict[str, Any]:
    """A run header as it goes on the wire (`_RUN_KEYS`)."""
    return {"layers": list(m.layers), "page_kind": m.page_kind, "name": m.name, "dtype": _DTYPE_NAMES[m.dtype],
            "shape": list(m.shape), "offset": m.offset, "nbytes": m.nbytes, "checksum": m.checksum}


def _place(buf: torch.Tensor, host: np.ndarray | None, metas: tuple[RunMeta, ...], sources: list[_Source],
           outs: list[torch.Tensor], srcs: list[torch.Tensor], gaps: list[torch.Tensor]) -> None:
    """Each run's place in `buf` and its source into `outs` / `srcs` (a stacked tensor on the
    buffer's device), or the run copied or stacked into its place at once (otherwise); the gap
    behind each run into `gaps` (the gap is summed: both sides must see zeros). `host`: the
    buffer's numpy view on the CPU, whose gaps are zeroed here: a small fill through torch costs
    milliseconds on a busy machine (its thread pool wakes up for 64 KiB) and numpy's memset does
    not."""
    for m, source in zip(metas, sources, strict=True):
        start, n = m.offset, m.nbytes
        if n:
            out = buf[start : start + n].view(m.dtype).view(len(m.layers), *m.shape)
            if isinstance(source, torch.Tensor) and source.device == buf.device:
                outs.append(out)
                srcs.append(source)
            elif isinstance(source, torch.Tensor):
                out.copy_(source)  # across devices: not batched
            else:
                if source[0].device != buf.device:  # host pages for a GPU buffer: the slow path
                    source = [t.to(buf.device) for t in source]
                torch.stack(source, out=out)  # pages hold no autograd history (exported under no_grad)
        end = align(start + n)
        if end > start + n:
            if host is not None:
                host[start + n : end] = 0
            else:
                gaps.append(buf[start + n : end])


def seal(metas: list[dict[str, Any]]) -> None:
    """Each run header's checksum recomputed from its fields (a header edited on purpose)."""
    for m in metas:
        m["checksum"] = zlib.crc32(_describe(
            m["layers"], m["page_kind"], m["name"], m["dtype"], m["shape"], m["offset"], m["nbytes"]
        ))


def _describe(layers: Any, kind: str, name: str, dtype: str, shape: Any, offset: int, nbytes: int) -> bytes:
    """The header fields a checksum covers, in one canonical byte string."""
    return msgpack.packb([list(layers), kind, name, dtype, list(shape), offset, nbytes], use_bin_type=True)
