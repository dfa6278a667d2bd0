"""The NCCL connector's messages: the side-channel control part, and the coalesced p2p buffer with
the msgpack list that says where each run of tensors sits in it.

Side channel (ZMQ), one multipart message each:
  hello  [token, control{kind="hello", gen, req_id="", nbytes=0}]: a sender joins generation `gen`
  data   [token, control{kind="data", gen, req_id, nbytes}, request header, request payload, runs]
  abort  [token, control{kind="abort", gen, req_id, nbytes=0}]: the sender gave `req_id` up
p2p: ONE uint8 buffer of `nbytes`. A run is the tensors of one name and shape over the layers
that have it (e.g. every SSM layer's "ssm" state), stacked in layer order; every run starts at a
BLOCK-aligned offset (nccl_checksum.py) and the gaps are zero-filled, so the receiver hands out
per-layer views of the buffer, no copy, and checks one checksum per run.

Parsing is as strict as wire.py's: every field typed and bounded, no ext types, and the runs
must tile the buffer exactly, in order, so a malformed header can never make the receiver read
outside the bytes it received.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from pd_ssm.cache.pages import PageRun, RequestState, StatePages
from pd_ssm.state_transfer.nccl_checksum import BLOCK, align, block_sums, tensor_checksum
from pd_ssm.state_transfer.wire import (
    DTYPES,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    MAX_PAYLOAD_BYTES,
    PAGE_KINDS,
    FrameError,
    decode_frame,
)

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_META_BYTES = 16 << 20  # the runs list: ~100 B per run plus the layer numbers
_RUN_KEYS = frozenset({"layers", "page_kind", "name", "dtype", "shape", "offset", "nbytes", "checksum"})
_CONTROL_KEYS = frozenset({"kind", "gen", "req_id", "nbytes"})
CONTROL_KINDS = ("hello", "data", "abort")


@dataclass(frozen=True, slots=True)
class Control:
    kind: str  # "hello" | "data"
    gen: int  # the pairing generation the p2p bytes travel on (nccl_group.py)
    req_id: str
    nbytes: int  # size of the p2p message that follows a "data" control; 0 for "hello"

    def encode(self) -> bytes:
        return msgpack.packb(
            {"kind": self.kind, "gen": self.gen, "req_id": self.req_id, "nbytes": self.nbytes}, use_bin_type=True
        )


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
    checksum: int  # nccl_checksum.tensor_checksum of this header and [offset, align(offset + nbytes))


_Source = torch.Tensor | list[torch.Tensor]  # a run's tensors: already stacked, or one per layer


def _runs(pages: StatePages) -> list[tuple[tuple[str, str, torch.dtype, torch.Size], list[int], _Source]]:
    """The pages' tensors grouped by (page kind, name, dtype, shape), layers ascending, in order of
    first appearance: a Mamba2 request is 2 runs (conv, ssm), a hybrid 4 (+ k, v). Pages that
    still come as runs (export_pages) are taken as they are; per-layer pages are grouped here, a
    loop over every tensor (128 for a 2.7B request), kept lean."""
    if pages.runs is not None:
        return [((r.kind, r.name, r.stacked.dtype, r.stacked.shape[1:]), list(r.layers), r.stacked)
                for r in pages.runs]
    runs: dict[tuple[str, str, torch.dtype, torch.Size], tuple[list[int], list[torch.Tensor]]] = {}
    layers = pages.layers
    for layer_idx in sorted(layers):
        page = layers[layer_idx]
        kind = page.kind
        for name, t in sorted(page.tensors.items()):
            key = (kind, name, t.dtype, t.shape)
            run = runs.get(key)
            if run is None:
                run = runs[key] = ([], [])
            run[0].append(layer_idx)
            run[1].append(t)
    return [(key, ids, tensors) for key, (ids, tensors) in runs.items()]


def pack(pages: StatePages, device: torch.device) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """`layout`, then `seal` (waits for the device): the buffer and its sealed run headers."""
    buf, metas = layout(pages, device)
    seal(metas, buf)
    return buf, metas


def layout(pages: StatePages, device: torch.device) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """All tensors in one uint8 buffer on `device` (queued on the current stream, not waited for),
    and the header of each run, its checksum still 0 (`seal` / `seal_sums` fill it in).

    Tensors of the same name and shape over the layers form a run, stacked by ONE kernel straight
    into its place in the buffer: per-tensor work in Python (128 tensors for Mamba2-2.7B) would
    cost milliseconds a request, more than moving its 168 MB over NVLink. The buffer is the only
    staging the NCCL path does (one p2p message is ~3x faster than one per tensor, TARGETS.md)."""
    runs = _runs(pages)
    metas: list[dict[str, Any]] = []
    offset = 0
    for (kind, name, dt, shape), layers, _ in runs:
        dtype = _DTYPE_NAMES.get(dt)
        if dtype is None:
            raise ValueError(f"dtype {dt} cannot go on the wire; allowed: {sorted(DTYPES)}")
        n = len(layers) * math.prod(shape) * dt.itemsize
        metas.append({"layers": layers, "page_kind": kind, "name": name, "dtype": dtype, "shape": list(shape),
                      "offset": offset, "nbytes": n, "checksum": 0})
        offset += align(n)
    buf = torch.empty(offset, dtype=torch.uint8, device=device)
    for m, ((_, _, dt, _), layers, source) in zip(metas, runs, strict=True):
        start, n = m["offset"], m["nbytes"]
        if n:
            out = buf[start : start + n].view(dt).view(len(layers), *m["shape"])
            if isinstance(source, torch.Tensor):
                out.copy_(source)  # across devices too
            else:
                if source[0].device != buf.device:  # host pages for a GPU buffer: the slow path
                    source = [t.to(buf.device) for t in source]
                torch.stack(source, out=out)  # pages hold no autograd history (exported under no_grad)
        buf[start + n : align(start + n)].zero_()  # the gap is summed: both sides must see zeros
    return buf, metas


def seal(metas: list[dict[str, Any]], buf: torch.Tensor) -> None:
    """Fill in each run header's checksum (over the header itself and its bytes in `buf`)."""
    seal_sums(metas, block_sums(buf))


def seal_sums(metas: list[dict[str, Any]], sums: bytes) -> None:
    """`seal` from the buffer's block sums (nccl_checksum.block_sums bytes), computed earlier."""
    for m in metas:
        m["checksum"] = tensor_checksum(sums, m["offset"], m["nbytes"], _describe(
            m["layers"], m["page_kind"], m["name"], m["dtype"], m["shape"], m["offset"], m["nbytes"]
        ))


def _describe(layers: Any, kind: str, name: str, dtype: str, shape: Any, offset: int, nbytes: int) -> bytes:
    """The header fields a checksum covers, in one canonical byte string."""
    return msgpack.packb([list(layers), kind, name, dtype, list(shape), offset, nbytes], use_bin_type=True)


def unpack(request: RequestState, metas: list[RunMeta], buf: torch.Tensor, device: torch.device) -> StatePages:
    """Verify every run's checksum, then return the runs as views of `buf` (one copy per run if
    `device` differs). A layer named twice, or with two page kinds, is refused here too."""
    sums = block_sums(buf)
    runs: list[PageRun] = []
    by_name: dict[str, set[int]] = {}  # set operations, not a Python loop over 128 tensors
    by_kind: dict[str, set[int]] = {}
    for m in metas:
        header = _describe(m.layers, m.page_kind, m.name, _DTYPE_NAMES[m.dtype], m.shape, m.offset, m.nbytes)
        got = tensor_checksum(sums, m.offset, m.nbytes, header)
        if got != m.checksum:
            raise FrameError(
                f"checksum mismatch on {m.name!r} of layers {list(m.layers)}: computed {got:#010x}, "
                f"sent {m.checksum:#010x}"
            )
        named = by_name.setdefault(m.name, set())
        clash = named.intersection(m.layers)
        for kind, layers in by_kind.items():
            if kind != m.page_kind:
                clash |= layers.intersection(m.layers)
        if clash:
            raise FrameError(f"layers {sorted(clash)}: tensor {m.name!r} repeated or page kinds disagree")
        named.update(m.layers)
        by_kind.setdefault(m.page_kind, set()).update(m.layers)
        stacked = buf[m.offset : m.offset + m.nbytes].view(m.dtype).view(len(m.layers), *m.shape)
        runs.append(PageRun(m.page_kind, m.name, m.layers, stacked.to(device)))
    return StatePages(request, runs=runs)


def _unpack_msgpack(raw: bytes, limit: int, what: str) -> Any:
    if len(raw) > limit:
        raise FrameError(f"{what} of {len(raw)} bytes exceeds the cap of {limit}")
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except Exception as e:
        raise FrameError(f"{what} is not valid msgpack: {type(e).__name__}: {e}") from e


def _no_ext(code: int, data: bytes) -> object:
    raise ValueError("ext types are not allowed in metadata")


def parse_control(raw: bytes) -> Control:
    c = _unpack_msgpack(raw, MAX_HEADER_BYTES, "control part")
    if not isinstance(c, dict) or set(c) != _CONTROL_KEYS:
        raise FrameError(f"control part must have exactly the keys {sorted(_CONTROL_KEYS)}: {c!r:.120}")
    kind, gen, req_id, nbytes = c["kind"], c["gen"], c["req_id"], c["nbytes"]
    if kind not in CONTROL_KINDS or type(req_id) is not str:
        raise FrameError(f"control part: bad kind or req_id: {c!r:.120}")
    if type(gen) is not int or type(nbytes) is not int or gen < 1 or nbytes < 0 or nbytes % BLOCK:
        raise FrameError(f"control part: gen must be >= 1, nbytes a non-negative multiple of {BLOCK}: {c!r:.120}")
    return Control(kind, gen, req_id, nbytes)


def parse_request(header: bytes, payload: bytes, req_id: str) -> RequestState:
    frame = decode_frame(header, payload)
    if frame.kind != "request" or frame.req_id != req_id or frame.body is None:
        raise FrameError(
            f"expected the request frame of {req_id!r}, got a {frame.kind} frame of {frame.req_id!r}"
        )
    return RequestState(**frame.body)


def parse_tensors(raw: bytes, total: int) -> list[RunMeta]:
    """Each run's header, checked: types, dtype, len(layers) x shape x itemsize == nbytes, and the
    runs tile [0, total) exactly, in order, each at the BLOCK-aligned end of the previous one."""
    items = _unpack_msgpack(raw, _MAX_META_BYTES, "runs part")
    if type(items) is not list:
        raise FrameError(f"runs part must be a msgpack list, got {type(items).__name__}")
    metas, offset = [], 0
    for d in items:
        if not isinstance(d, dict) or set(d) != _RUN_KEYS:
            raise FrameError(f"run header must have exactly the keys {sorted(_RUN_KEYS)}: {d!r:.120}")
        ints = [d[k] for k in ("offset", "nbytes", "checksum")]
        if any(type(v) is not int or v < 0 for v in ints):
            raise FrameError(f"run header: offset, nbytes, checksum must be non-negative ints: {d!r:.120}")
        layers = d["layers"]
        if (
            type(layers) is not list
            or not layers
            or any(type(v) is not int or v < 0 for v in layers)
            or any(a >= b for a, b in zip(layers, layers[1:], strict=False))
        ):
            raise FrameError(f"run header: layers must be a non-empty ascending list of layer numbers: {d!r:.120}")
        if d["page_kind"] not in PAGE_KINDS or type(d["name"]) is not str or d["dtype"] not in DTYPES:
            raise FrameError(f"run header: bad page_kind, name or dtype: {d!r:.120}")
        shape = d["shape"]
        if (
            type(shape) is not list
            or len(shape) > MAX_NDIM
            or any(type(s) is not int or s < 0 for s in shape)
        ):
            raise FrameError(
                f"run header: shape must be a list of <= {MAX_NDIM} non-negative ints: {shape!r:.80}"
            )
        dtype = DTYPES[d["dtype"]]
        one = math.prod(shape) * dtype.itemsize
        if one > MAX_PAYLOAD_BYTES or len(layers) * one != d["nbytes"]:
            raise FrameError(f"run header: {len(layers)} layers x shape {shape} x {dtype.itemsize} B != nbytes {d['nbytes']}")
        if d["offset"] != offset:
            raise FrameError(f"run header: offset {d['offset']} but the previous run ended at {offset}")
        offset += align(d["nbytes"])
        metas.append(RunMeta(tuple(layers), d["page_kind"], d["name"], dtype, tuple(shape), d["offset"], d["nbytes"],
                             d["checksum"]))
    if offset != total:
        raise FrameError(f"run headers cover {offset} bytes but the p2p message has {total}")
    return metas
