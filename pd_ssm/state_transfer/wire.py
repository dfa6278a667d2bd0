"""Wire frames: how StatePages travel between processes. Nothing on the wire is ever unpickled.

Every frame is two parts, `[header, payload]`:

  header   a msgpack map (no ext types, str keys)
             magic b"PDSM", version 3, kind "page" | "run" | "request" | "end" | "abort", req_id,
             nbytes, checksum
             + for "page": layer, page_kind ("ssm" | "attention"), name, dtype, shape
             + for "run":  layers (ascending), page_kind, name, dtype, shape (of ONE layer's tensor)
  payload  "page":              the tensor's raw bytes, C order, native (little-endian) byte order
           "run":               the layers' tensors of `name`, stacked in `layers` order: bytes as
                                one tensor [len(layers), *shape]
           "request" / "end":   a msgpack map (the RequestState fields / {"num_frames": n})
           "abort":             a msgpack map {"reason": str}

A run frame carries what would be len(layers) page frames (e.g. the SSM state of layers 0..63) at
the fixed cost of one: encoding, parsing and checking a frame cost ~40 us a side in Python, which
capped a 2.7B request of 128 page frames at ~0.4x the loopback socket in bf16. A request is sent
as one "request" frame and page / run frames that carry each (layer, tensor) exactly once, in any
order (layer-wise streaming sends pages as layers finish), then one "end" frame whose num_frames
counts the frames before it; `PageAssembler` checks that everything arrived exactly once. A
sender that gives up on a request it already streamed pages of sends one "abort" frame, so the
receiver releases the reservation at once instead of at its expiry.

Checksum (version 2 on): zlib.crc32 over the frame's identity fields (kind, req_id, layer, layers,
page_kind, name, dtype, shape, nbytes, msgpack-packed), then the little-endian sums mod 2**64 of
each 4 KiB block's 8-byte words, then the payload's 512 lane sums (per 8-byte offset within a
block, over all blocks); the last block zero-padded (checksum.payload_checksum). Summing runs at
~8 GB/s a core where crc32 over every byte ran at 2-3 GB/s, which capped the loopback transfer,
and pieces of one payload can be summed by several threads (`parse_frame` / `seal` take their
sums). Both peers use the standard library and numpy, so they always agree on the algorithm (an
optional xxhash would let two peers silently disagree).

What it catches: a header that still parses but names the wrong layer or shape; any single
flipped bit (it changes its block's sum); any change to 1-3 words (a pair that cancels in its
block's sum sits in two lanes); truncated, shifted, stale or zeroed data; swapped or repeated
blocks (the crc32 is over the ordered sums). What it misses: changes to >= 4 words that cancel in
both views (e.g. the same two offsets in two blocks). It guards against corruption and bugs, not
adversaries (peers authenticate with the cluster token); TCP has its own link checksum.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from pd_ssm.cache.pages import PageRun, RequestState, StatePages, runs_of
from pd_ssm.state_transfer.checksum import WireSums, checksum_of_sums, wire_sums
from pd_ssm.state_transfer.wire_fields import (
    FrameError,
    check_body,
    layer_list,
    nonneg_int,
    shape,
    typed,
    unpack,
)

MAGIC = b"PDSM"
VERSION = 3  # 3: run frames (2: block-sum checksums; 1: crc32 over every payload byte)
MAX_HEADER_BYTES = 64 << 10
MAX_PAYLOAD_BYTES = 16 << 30  # one page or run; a Mamba2-2.7B SSM page is 2.6 MB, its run 168 MB
MAX_BODY_BYTES = 64 << 20  # request bodies hold token ids: ~5 B per token
MAX_NDIM = 8
MAX_RUN_LAYERS = 4096  # layers of one run frame (a model's layers; the header cap allows ~20k)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
KINDS = ("page", "run", "request", "end", "abort")
TENSOR_KINDS = ("page", "run")
PAGE_KINDS = ("ssm", "attention")

_COMMON = frozenset({"magic", "version", "kind", "req_id", "nbytes", "checksum"})
_FIELDS = {
    "page": _COMMON | {"layer", "page_kind", "name", "dtype", "shape"},
    "run": _COMMON | {"layers", "page_kind", "name", "dtype", "shape"},
    "request": _COMMON,
    "end": _COMMON,
    "abort": _COMMON,
}
# the header fields the checksum covers (absent ones as None), in this order
_IDENTITY = ("kind", "req_id", "layer", "layers", "page_kind", "name", "dtype", "shape", "nbytes")
# The body of a "request" frame is exactly RequestState's fields: a renamed field fails loudly.
_REQUEST_ORDER = tuple(f.name for f in dataclasses.fields(RequestState))
_REQUEST_FIELDS = frozenset(_REQUEST_ORDER)

Parts = list[bytes | memoryview]
Buffer = bytes | bytearray | memoryview


class Frame(NamedTuple):
    kind: str  # "page" | "run" | "request" | "end" | "abort"
    req_id: str
    layer_idx: int | None = None  # page frames only
    page_kind: str | None = None  # page and run frames
    name: str | None = None
    tensor: torch.Tensor | None = None  # CPU; owns its memory, or views the payload (copy=False)
    body: dict[str, Any] | None = None  # request / end / abort frames only
    layers: tuple[int, ...] | None = None  # run frames only; `tensor` is [len(layers), *shape]


# ------------------------------------------------------------------------------------ encode


class Unsealed(NamedTuple):
    """A frame's header fields (all but magic, version, checksum) and its payload, not yet
    checksummed: `seal` packs it once its payload's sums are in (from a pool, or computed there)."""

    header: dict[str, Any]
    payload: memoryview


def page_frame(req_id: str, layer_idx: int, page_kind: str, name: str, tensor: torch.Tensor) -> Unsealed:
    """One layer's tensor; the payload is a zero-copy view of it (copied only if non-contiguous).

    The tensor must be on the CPU: connectors stage GPU pages into (pinned) host buffers themselves."""
    return _tensor_frame({"kind": "page", "req_id": req_id, "layer": layer_idx}, page_kind, name, tensor)


def run_frame(req_id: str, layers: Sequence[int], page_kind: str, name: str, stacked: torch.Tensor) -> Unsealed:
    """The tensors of `name` of `layers` (ascending), stacked: `stacked` is [len(layers), *shape]."""
    if not layers or list(layers) != sorted(set(layers)) or min(layers) < 0:
        raise ValueError(f"a run needs ascending, distinct layer numbers >= 0, got {list(layers)[:16]}")
    if stacked.dim() < 1 or stacked.shape[0] != len(layers):
        raise ValueError(f"a run of {len(layers)} layers needs a tensor [{len(layers)}, ...], got {tuple(stacked.shape)}")
    fields = {"kind": "run", "req_id": req_id, "layers": list(layers)}
    return _tensor_frame(fields, page_kind, name, stacked, shape=list(stacked.shape[1:]))


def _tensor_frame(
    fields: dict[str, Any], page_kind: str, name: str, tensor: torch.Tensor, shape: list[int] | None = None
) -> Unsealed:
    if page_kind not in PAGE_KINDS:
        raise ValueError(f"page kind must be one of {PAGE_KINDS}, got {page_kind!r}")
    if tensor.device.type != "cpu":
        raise ValueError(f"a frame needs a CPU tensor (stage it to host first), got {tensor.device}")
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"dtype {tensor.dtype} cannot go on the wire; allowed: {sorted(DTYPES)}")
    t = tensor.detach().contiguous()
    # NOTE: numpy has no bfloat16, so every dtype goes out as its raw bytes; the ndarray keeps
    # `t` alive as long as the memoryview lives.
    payload = t.reshape(-1).view(torch.uint8).numpy().data
    fields.update(page_kind=page_kind, name=name, dtype=dtype, shape=list(t.shape) if shape is None else shape,
                  nbytes=payload.nbytes)
    return Unsealed(fields, payload)


def seal(frame: Unsealed, sums: Sequence[WireSums] | None = None) -> Parts:
    """[header, payload] with the checksum in the header: from `sums` (the payload's pieces in
    order, checksum.sum_shares) or, if None, summed here."""
    return [_pack_header(frame.header, frame.payload, sums), frame.payload]


def encode_page(req_id: str, layer_idx: int, page_kind: str, name: str, tensor: torch.Tensor) -> Parts:
    """[header, payload] of one layer's tensor (`page_frame`, sealed here)."""
    return seal(page_frame(req_id, layer_idx, page_kind, name, tensor))


def encode_run(req_id: str, layers: Sequence[int], page_kind: str, name: str, stacked: torch.Tensor) -> Parts:
    """[header, payload] of several layers' tensors of one name (`run_frame`, sealed here)."""
    return seal(run_frame(req_id, layers, page_kind, name, stacked))


def encode_request(state: RequestState) -> Parts:
    body = {f: getattr(state, f) for f in _REQUEST_ORDER}
    return _encode_body("request", state.req_id, body)


def encode_end(req_id: str, num_frames: int) -> Parts:
    """The last frame of a request: `num_frames` = frames sent for it before this one."""
    return _encode_body("end", req_id, {"num_frames": num_frames})


def encode_abort(req_id: str, reason: str) -> Parts:
    """The sender gave up on `req_id`: the receiver drops what arrived and releases its place."""
    return _encode_body("abort", req_id, {"reason": reason})


def pages_to_frames(pages: StatePages) -> list[Parts]:
    """A whole request: its request frame, one frame per run (a page frame for a run of one layer;
    per-layer pages are stacked into runs first, a copy), its end frame."""
    runs = pages.runs if pages.runs is not None else runs_of(pages.layers)
    frames = [encode_request(pages.request), *(_encode_run(pages.req_id, r) for r in runs)]
    frames.append(encode_end(pages.req_id, len(frames)))
    return frames


def _encode_run(req_id: str, run: PageRun) -> Parts:
    if len(run.layers) == 1:
        return encode_page(req_id, run.layers[0], run.kind, run.name, run.stacked[0])
    return encode_run(req_id, run.layers, run.kind, run.name, run.stacked)


def _encode_body(kind: str, req_id: str, body: dict[str, Any]) -> Parts:
    payload = msgpack.packb(body, use_bin_type=True)
    return seal(Unsealed({"kind": kind, "req_id": req_id, "nbytes": len(payload)}, memoryview(payload)))


def _pack_header(fields: dict[str, Any], payload: Buffer, sums: Sequence[WireSums] | None) -> bytes:
    header = {"magic": MAGIC, "version": VERSION, **fields}
    header["checksum"] = _checksum(header, payload, sums)
    return msgpack.packb(header, use_bin_type=True)


def _checksum(header: dict[str, Any], payload: Buffer, sums: Sequence[WireSums] | None = None) -> int:
    ident = msgpack.packb([header.get(k) for k in _IDENTITY], use_bin_type=True)
    return checksum_of_sums(ident, [wire_sums(payload)] if sums is None else sums)


# ------------------------------------------------------------------------------------ decode


class Parsed(NamedTuple):
    """A frame whose header checked out, its payload's length too; its checksum not verified yet
    (`finish_frame`), so a pool may sum pieces of `payload` first."""

    kind: str
    req_id: str
    header: dict[str, Any]
    payload: memoryview
    checksum: int
    layers: tuple[int, ...] | None = None  # page and run frames: the layer(s) it carries
    dtype: torch.dtype | None = None
    shape: list[int] | None = None  # of one layer's tensor


def decode_frame(header: Buffer, payload: Buffer | None, copy: bool = True) -> Frame:
    """Check every field of a frame and build it; raises FrameError, and nothing else, on bad input.

    `copy=False` (a connector's receive path): a page's or run's tensor is a view of `payload` when
    that is a writable buffer, and keeps it alive -- no copy of the bytes; else it is copied.
    """
    return finish_frame(parse_frame(header, payload), None, copy)


def parse_frame(header: Buffer, payload: Buffer | None) -> Parsed:
    """Every check of `decode_frame` but the checksum; raises FrameError only."""
    h = unpack(header, MAX_HEADER_BYTES, "header")
    if not isinstance(h, dict):
        raise FrameError(f"frame header must be a msgpack map, got {type(h).__name__}")
    if h.get("magic") != MAGIC:
        raise FrameError(f"bad magic {h.get('magic')!r} (expected {MAGIC!r}): not a pd_ssm frame")
    version = h.get("version")
    if version != VERSION or type(version) is not int:
        raise FrameError(f"unsupported frame version {version!r}; this build reads version {VERSION}")
    kind = h.get("kind")
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind!r}; expected one of {KINDS}")
    keys = set(h)
    if keys != _FIELDS[kind]:
        missing, extra = sorted(_FIELDS[kind] - keys), sorted(map(str, keys - _FIELDS[kind]))
        raise FrameError(f"{kind} frame header: missing fields {missing}, unexpected fields {extra}")
    req_id = typed(h, "req_id", str)
    nbytes = nonneg_int(h, "nbytes")
    checksum = nonneg_int(h, "checksum")
    if payload is None:
        raise FrameError(f"{kind} frame of {req_id!r} has no payload part")
    try:
        view = memoryview(payload)
    except TypeError as e:
        raise FrameError(f"payload must be a bytes-like object, got {type(payload).__name__}") from e
    if not view.c_contiguous:
        raise FrameError(f"{kind} frame of {req_id!r}: payload buffer is not contiguous")
    got = view.nbytes
    if got != nbytes:
        raise FrameError(f"{kind} frame of {req_id!r}: payload has {got} bytes, header says {nbytes} (truncated?)")
    if kind not in TENSOR_KINDS:
        if nbytes > MAX_BODY_BYTES:
            raise FrameError(f"{kind} body of {nbytes} bytes exceeds the cap of {MAX_BODY_BYTES}")
        return Parsed(kind, req_id, h, view, checksum)

    layers = (nonneg_int(h, "layer"),) if kind == "page" else layer_list(h["layers"], MAX_RUN_LAYERS)
    page_kind = typed(h, "page_kind", str)
    if page_kind not in PAGE_KINDS:
        raise FrameError(f"unknown page kind {page_kind!r}; expected one of {PAGE_KINDS}")
    typed(h, "name", str)
    dtype_name = typed(h, "dtype", str)
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise FrameError(f"dtype {dtype_name!r} is not allowed on the wire; allowed: {sorted(DTYPES)}")
    dims = shape(h["shape"], dtype.itemsize, MAX_NDIM, MAX_PAYLOAD_BYTES)
    if nbytes > MAX_PAYLOAD_BYTES or len(layers) * math.prod(dims) * dtype.itemsize != nbytes:
        per = "" if kind == "page" else f"{len(layers)} layers x "
        raise FrameError(f"{per}shape {dims} x {dtype.itemsize} B ({dtype_name}) != nbytes {nbytes}")
    return Parsed(kind, req_id, h, view, checksum, layers, dtype, dims)


def finish_frame(p: Parsed, sums: Sequence[WireSums] | None = None, copy: bool = True) -> Frame:
    """Verify a parsed frame's checksum -- from `sums` of its payload's pieces in order
    (checksum.sum_shares), or summed here if None -- and build the Frame; FrameError only."""
    got = _checksum(p.header, p.payload, sums)
    h = p.header
    if got != p.checksum:
        if p.layers is None:
            what = f"{p.kind} frame"
        else:
            what = f"layer{'s' if p.kind == 'run' else ''} {_layer_text(p.layers)} {h['name']!r}"
        raise FrameError(f"checksum mismatch on {what} of {p.req_id!r}: computed {got:#010x}, header says {p.checksum:#010x}")
    if p.layers is None:
        body = check_body(p.kind, unpack(p.payload, MAX_BODY_BYTES, f"{p.kind} body"), p.req_id, _REQUEST_FIELDS)
        return Frame(p.kind, p.req_id, body=body)
    assert p.dtype is not None and p.shape is not None
    if p.kind == "page":
        tensor = _to_tensor(p.payload, p.dtype, p.shape, copy)
        return Frame("page", p.req_id, p.layers[0], h["page_kind"], h["name"], tensor=tensor)
    tensor = _to_tensor(p.payload, p.dtype, [len(p.layers), *p.shape], copy)
    return Frame("run", p.req_id, None, h["page_kind"], h["name"], tensor=tensor, layers=p.layers)


def _layer_text(layers: tuple[int, ...]) -> str:
    return str(layers[0]) if len(layers) == 1 else f"{list(layers[:8])}{'...' if len(layers) > 8 else ''}"


def _to_tensor(payload: memoryview, dtype: torch.dtype, dims: list[int], copy: bool) -> torch.Tensor:
    if not copy and not payload.readonly and payload.nbytes > 0:
        # NOTE: frombuffer holds a reference to the buffer (a received ZMQ frame), so it lives as
        # long as the tensor; a copy into fresh memory costs more than the network on loopback
        flat = payload if payload.format == "B" else payload.cast("B")
        return torch.frombuffer(flat, dtype=torch.uint8).view(dtype).reshape(dims)
    out = torch.empty(dims, dtype=dtype)
    # one copy, into memory torch owns (aligned), so the receive buffer can be released at once
    out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
    return out
