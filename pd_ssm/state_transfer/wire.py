"""Wire frames: how StatePages travel between processes. Nothing on the wire is ever unpickled.

Every frame is two parts, `[header, payload]`:

  header   a msgpack map (no ext types, str keys)
             magic b"PDSM", version 2, kind "page" | "request" | "end" | "abort", req_id, nbytes,
             checksum
             + for "page": layer, page_kind ("ssm" | "attention"), name, dtype, shape
  payload  "page":              the tensor's raw bytes, C order, native (little-endian) byte order
           "request" / "end":   a msgpack map (the RequestState fields / {"num_frames": n})
           "abort":             a msgpack map {"reason": str}

A request is sent as one "request" frame and one "page" frame per (layer, tensor), in any order
(layer-wise streaming sends pages as layers finish), then one "end" frame whose num_frames counts
the frames before it; `PageAssembler` checks that everything arrived exactly once. A sender that
gives up on a request it already streamed pages of sends one "abort" frame, so the receiver
releases the reservation at once instead of at its expiry.

Checksum (version 2): zlib.crc32 over the frame's identity fields (kind, req_id, layer, page_kind,
name, dtype, shape, nbytes, msgpack-packed), then the little-endian sums mod 2**64 of each 4 KiB
block's 8-byte words, then the payload's 512 lane sums (per 8-byte offset within a block, over all
blocks); the last block zero-padded (checksum.payload_checksum). Summing runs at ~8 GB/s a core
where crc32 over every byte ran at 2-3 GB/s, which capped the loopback transfer. Both peers use
the standard library and numpy, so they always agree on the algorithm (an optional xxhash would
let two peers silently disagree).

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
from collections.abc import Iterable
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages
from pd_ssm.state_transfer.checksum import payload_checksum

MAGIC = b"PDSM"
VERSION = 2  # 2: block-sum checksums (1: crc32 over every payload byte)
MAX_HEADER_BYTES = 64 << 10
MAX_PAYLOAD_BYTES = 16 << 30  # one tensor; a Mamba2-2.7B SSM page is 2.6 MB
MAX_BODY_BYTES = 64 << 20  # request bodies hold token ids: ~5 B per token
MAX_NDIM = 8
MAX_BODY_DEPTH = 32
MAX_BODY_ITEMS = 1 << 22

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
KINDS = ("page", "request", "end", "abort")
PAGE_KINDS = ("ssm", "attention")

_COMMON = frozenset({"magic", "version", "kind", "req_id", "nbytes", "checksum"})
_FIELDS = {
    "page": _COMMON | {"layer", "page_kind", "name", "dtype", "shape"},
    "request": _COMMON,
    "end": _COMMON,
    "abort": _COMMON,
}
# The body of a "request" frame is exactly RequestState's fields: a renamed field fails loudly.
_REQUEST_ORDER = tuple(f.name for f in dataclasses.fields(RequestState))
_REQUEST_FIELDS = frozenset(_REQUEST_ORDER)

Parts = list[bytes | memoryview]
Buffer = bytes | bytearray | memoryview


class FrameError(ValueError):
    """A frame failed a check; the request it belongs to must fail (and release its pages)."""


class Frame(NamedTuple):
    kind: str  # "page" | "request" | "end" | "abort"
    req_id: str
    layer_idx: int | None = None  # page frames only
    page_kind: str | None = None
    name: str | None = None
    tensor: torch.Tensor | None = None  # CPU; owns its memory, or views the payload (copy=False)
    body: dict[str, Any] | None = None  # request / end / abort frames only


# ------------------------------------------------------------------------------------ encode


def encode_page(req_id: str, layer_idx: int, page_kind: str, name: str, tensor: torch.Tensor) -> Parts:
    """[header, payload]; the payload is a zero-copy view of `tensor` (copied only if non-contiguous).

    The tensor must be on the CPU: connectors stage GPU pages into (pinned) host buffers themselves.
    """
    if page_kind not in PAGE_KINDS:
        raise ValueError(f"page kind must be one of {PAGE_KINDS}, got {page_kind!r}")
    if tensor.device.type != "cpu":
        raise ValueError(f"encode_page needs a CPU tensor (stage it to host first), got {tensor.device}")
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"dtype {tensor.dtype} cannot go on the wire; allowed: {sorted(DTYPES)}")
    t = tensor.detach().contiguous()
    # NOTE: numpy has no bfloat16, so every dtype goes out as its raw bytes; the ndarray keeps
    # `t` alive as long as the memoryview lives.
    payload = t.reshape(-1).view(torch.uint8).numpy().data
    header = {
        "kind": "page",
        "req_id": req_id,
        "layer": layer_idx,
        "page_kind": page_kind,
        "name": name,
        "dtype": dtype,
        "shape": list(t.shape),
        "nbytes": payload.nbytes,
    }
    return [_pack_header(header, payload), payload]


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
    frames = [encode_request(pages.request), *layers_to_frames(pages.req_id, pages.layers.values())]
    frames.append(encode_end(pages.req_id, len(frames)))
    return frames


def layers_to_frames(req_id: str, layers: Iterable[LayerPages]) -> list[Parts]:
    """One page frame per (layer, tensor), layers and names in sorted order."""
    return [
        encode_page(req_id, page.layer_idx, page.kind, name, page.tensors[name])
        for page in sorted(layers, key=lambda p: p.layer_idx)
        for name in sorted(page.tensors)
    ]


def _encode_body(kind: str, req_id: str, body: dict[str, Any]) -> Parts:
    payload = msgpack.packb(body, use_bin_type=True)
    header = {"kind": kind, "req_id": req_id, "nbytes": len(payload)}
    return [_pack_header(header, payload), payload]


def _pack_header(fields: dict[str, Any], payload: Buffer) -> bytes:
    header = {"magic": MAGIC, "version": VERSION, **fields}
    header["checksum"] = _checksum(header, payload)
    return msgpack.packb(header, use_bin_type=True)


def _checksum(header: dict[str, Any], payload: Buffer) -> int:
    ident = [header.get(k) for k in ("kind", "req_id", "layer", "page_kind", "name", "dtype", "shape", "nbytes")]
    return payload_checksum(msgpack.packb(ident, use_bin_type=True), payload)


# ------------------------------------------------------------------------------------ decode


def decode_frame(header: Buffer, payload: Buffer | None, copy: bool = True) -> Frame:
    """Check every field of a frame and build it; raises FrameError, and nothing else, on bad input.

    `copy=False` (a connector's receive path): a page's tensor is a view of `payload` when that is
    a writable buffer, and keeps it alive -- no copy of the bytes; else it is copied as usual.
    """
    h = _unpack(header, MAX_HEADER_BYTES, "header")
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
    req_id = _typed(h, "req_id", str)
    nbytes = _nonneg_int(h, "nbytes")
    checksum = _nonneg_int(h, "checksum")
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

    if kind == "page":
        layer = _nonneg_int(h, "layer")
        page_kind = _typed(h, "page_kind", str)
        if page_kind not in PAGE_KINDS:
            raise FrameError(f"unknown page kind {page_kind!r}; expected one of {PAGE_KINDS}")
        name = _typed(h, "name", str)
        dtype_name = _typed(h, "dtype", str)
        dtype = DTYPES.get(dtype_name)
        if dtype is None:
            raise FrameError(f"dtype {dtype_name!r} is not allowed on the wire; allowed: {sorted(DTYPES)}")
        shape = _shape(h["shape"], dtype.itemsize)
        if math.prod(shape) * dtype.itemsize != nbytes:
            raise FrameError(f"shape {shape} x {dtype.itemsize} B ({dtype_name}) != nbytes {nbytes}")
        _verify(h, payload, checksum, f"layer {layer} {name!r} of {req_id!r}")
        return Frame("page", req_id, layer, page_kind, name, tensor=_to_tensor(view, dtype, shape, copy))

    if nbytes > MAX_BODY_BYTES:
        raise FrameError(f"{kind} body of {nbytes} bytes exceeds the cap of {MAX_BODY_BYTES}")
    _verify(h, payload, checksum, f"{kind} frame of {req_id!r}")
    body = _unpack(payload, MAX_BODY_BYTES, f"{kind} body")
    if not isinstance(body, dict):
        raise FrameError(f"{kind} body must be a msgpack map, got {type(body).__name__}")
    if kind == "request":
        _check_request_body(body, req_id)
    elif kind == "abort":
        if set(body) != {"reason"}:
            raise FrameError(f"abort body must be exactly {{'reason'}}, got {sorted(map(str, body))}")
        _typed(body, "reason", str)
    else:
        if set(body) != {"num_frames"}:
            raise FrameError(f"end body must be exactly {{'num_frames'}}, got {sorted(map(str, body))}")
        _nonneg_int(body, "num_frames")
    return Frame(kind, req_id, body=body)


class _ExtRefused(Exception):
    pass


def _refuse_ext(code: int, data: bytes) -> Any:
    raise _ExtRefused(f"msgpack ext type {code} is not allowed in frames")


def _unpack(buf: Buffer, limit: int, what: str) -> Any:
    try:
        n = memoryview(buf).nbytes
    except TypeError as e:
        raise FrameError(f"{what} must be a bytes-like object, got {type(buf).__name__}") from e
    if n > limit:
        raise FrameError(f"{what} of {n} bytes exceeds the cap of {limit}")
    try:
        # NOTE: the C unpacker is bounded (nesting stack, lengths <= buffer size); any failure,
        # including our ext refusal, a bad UTF-8 string or trailing bytes, is a bad frame.
        return msgpack.unpackb(buf, raw=False, strict_map_key=True, ext_hook=_refuse_ext, use_list=True)
    except Exception as e:
        raise FrameError(f"{what} is not valid msgpack for a frame: {type(e).__name__}: {e}") from e


def _typed(d: dict[str, Any], key: str, typ: type) -> Any:
    v = d[key]
    if type(v) is not typ:
        raise FrameError(f"field {key!r} must be {typ.__name__}, got {type(v).__name__} {v!r:.80}")
    return v


def _nonneg_int(d: dict[str, Any], key: str) -> int:
    v: int = _typed(d, key, int)
    if v < 0:
        raise FrameError(f"field {key!r} must be >= 0, got {v}")
    return v


def _shape(raw: Any, itemsize: int) -> list[int]:
    if type(raw) is not list or len(raw) > MAX_NDIM:
        raise FrameError(f"shape must be a list of at most {MAX_NDIM} ints, got {raw!r:.80}")
    total = itemsize
    for d in raw:
        if type(d) is not int or d < 0:
            raise FrameError(f"shape {raw!r:.80} has a dimension that is not a non-negative int")
        total *= d
    if total > MAX_PAYLOAD_BYTES:
        raise FrameError(f"shape {raw} declares {total} bytes, over the cap of {MAX_PAYLOAD_BYTES}")
    return list(raw)


def _verify(h: dict[str, Any], payload: Buffer, checksum: int, what: str) -> None:
    got = _checksum(h, payload)
    if got != checksum:
        raise FrameError(f"checksum mismatch on {what}: computed {got:#010x}, header says {checksum:#010x}")


def _to_tensor(payload: memoryview, dtype: torch.dtype, shape: list[int], copy: bool) -> torch.Tensor:
    if not copy and not payload.readonly and payload.nbytes > 0:
        # NOTE: frombuffer holds a reference to the buffer (a received ZMQ frame), so it lives as
        # long as the tensor; a copy into fresh memory costs more than the network on loopback
        flat = payload if payload.format == "B" else payload.cast("B")
        return torch.frombuffer(flat, dtype=torch.uint8).view(dtype).reshape(shape)
    out = torch.empty(shape, dtype=dtype)
    # one copy, into memory torch owns (aligned), so the receive buffer can be released at once
    out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
    return out


def _check_request_body(body: dict[str, Any], req_id: str) -> None:
    if set(body) != _REQUEST_FIELDS:
        missing, extra = sorted(_REQUEST_FIELDS - set(body)), sorted(map(str, set(body) - _REQUEST_FIELDS))
        raise FrameError(f"request body of {req_id!r}: missing fields {missing}, unexpected fields {extra}")
    if body["req_id"] != req_id:
        raise FrameError(f"request body names {body['req_id']!r} but the header names {req_id!r}")
    for key in ("prompt_token_ids", "output_token_ids"):
        ids = _typed(body, key, list)
        # NOTE: set(map(type)) and min run in C: a per-item generator cost ~0.2 ms for 2048 ids
        if ids and (set(map(type, ids)) != {int} or min(ids) < 0):
            raise FrameError(f"request {req_id!r}: {key} must be a list of non-negative ints")
    for key in ("num_computed_tokens", "max_tokens"):
        _nonneg_int(body, key)
    _typed(body, "seed", int)
    if body["prompt"] is not None:
        _typed(body, "prompt", str)
    _check_plain(_typed(body, "params", dict), f"request {req_id!r} params")


def _check_plain(obj: Any, what: str) -> None:
    """Only plain msgpack values (msgpack.Timestamp bypasses ext_hook); iterative, bounded."""
    stack, items = [(obj, 0)], 0
    while stack:
        v, depth = stack.pop()
        items += 1
        if depth > MAX_BODY_DEPTH or items > MAX_BODY_ITEMS:
            raise FrameError(f"{what} nest deeper than {MAX_BODY_DEPTH} or hold over {MAX_BODY_ITEMS} items")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
        elif v is not None and type(v) not in (bool, int, float, str, bytes):
            raise FrameError(f"{what} hold a {type(v).__name__}; only plain msgpack values are allowed")
