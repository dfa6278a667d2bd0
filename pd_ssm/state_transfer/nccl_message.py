"""The NCCL connector's coalesced message: all of a request's tensors in one uint8 buffer, and the
msgpack metadata (sent over the ZMQ side channel) that says where each tensor sits in it.

Parsing is as strict as wire.py's: every field typed and bounded, no ext types, and the tensors
must tile the buffer exactly, in order, so a malformed header can never make the receiver read
outside the bytes it received.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import msgpack
import torch

from pd_ssm.cache.pages import RequestState, StatePages
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
_MAX_META_BYTES = 16 << 20  # the tensors list: ~100 B per tensor
_TENSOR_KEYS = frozenset({"layer", "page_kind", "name", "dtype", "shape", "offset", "nbytes", "checksum"})


class TensorMeta:
    """One tensor's place in the coalesced buffer."""

    __slots__ = ("layer", "page_kind", "name", "dtype", "shape", "offset", "nbytes", "checksum")

    def __init__(self, d: dict[str, Any]) -> None:
        self.layer: int = d["layer"]
        self.page_kind: str = d["page_kind"]
        self.name: str = d["name"]
        self.dtype: torch.dtype = DTYPES[d["dtype"]]
        self.shape: list[int] = d["shape"]
        self.offset: int = d["offset"]
        self.nbytes: int = d["nbytes"]
        self.checksum: int | None = d["checksum"]


def pack(pages: StatePages, device: torch.device) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """All tensors back to back in one uint8 buffer on `device`, and each one's metadata."""
    items = []
    for layer_idx in sorted(pages.layers):
        page = pages.layers[layer_idx]
        for name in sorted(page.tensors):
            t = page.tensors[name]
            dtype = _DTYPE_NAMES.get(t.dtype)
            if dtype is None:
                raise ValueError(f"dtype {t.dtype} cannot go on the wire; allowed: {sorted(DTYPES)}")
            items.append((layer_idx, page.kind, name, dtype, t))
    total = sum(t.numel() * t.element_size() for *_, t in items)
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    host = buf.numpy() if device.type == "cpu" else None
    metas, offset = [], 0
    for layer_idx, kind, name, dtype, t in items:
        n = t.numel() * t.element_size()
        chunk = buf[offset : offset + n]
        chunk.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        checksum = zlib.crc32(host[offset : offset + n].data) if host is not None else None
        metas.append(
            {
                "layer": layer_idx,
                "page_kind": kind,
                "name": name,
                "dtype": dtype,
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": n,
                "checksum": checksum,
            }
        )
        offset += n
    return buf, metas


def _unpack_msgpack(raw: bytes, limit: int, what: str) -> Any:
    if len(raw) > limit:
        raise FrameError(f"{what} of {len(raw)} bytes exceeds the cap of {limit}")
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except Exception as e:
        raise FrameError(f"{what} is not valid msgpack: {type(e).__name__}: {e}") from e


def _no_ext(code: int, data: bytes) -> object:
    raise ValueError("ext types are not allowed in metadata")


def parse_control(raw: bytes) -> tuple[str, int] | None:
    try:
        c = _unpack_msgpack(raw, MAX_HEADER_BYTES, "control part")
    except FrameError:
        return None
    if not isinstance(c, dict) or set(c) != {"req_id", "nbytes"}:
        return None
    req_id, nbytes = c["req_id"], c["nbytes"]
    if type(req_id) is not str or type(nbytes) is not int or nbytes < 0:
        return None
    return req_id, nbytes


def parse_request(header: bytes, payload: bytes, req_id: str) -> RequestState:
    frame = decode_frame(header, payload)
    if frame.kind != "request" or frame.req_id != req_id or frame.body is None:
        raise FrameError(
            f"expected the request frame of {req_id!r}, got a {frame.kind} frame of {frame.req_id!r}"
        )
    return RequestState(**frame.body)


def parse_tensors(raw: bytes, total: int) -> list[TensorMeta]:
    """Each tensor's header, checked: types, dtype, shape x itemsize == nbytes, and the tensors
    tile [0, total) exactly, in order."""
    items = _unpack_msgpack(raw, _MAX_META_BYTES, "tensors part")
    if type(items) is not list:
        raise FrameError(f"tensors part must be a msgpack list, got {type(items).__name__}")
    metas, offset = [], 0
    for d in items:
        if not isinstance(d, dict) or set(d) != _TENSOR_KEYS:
            raise FrameError(f"tensor header must have exactly the keys {sorted(_TENSOR_KEYS)}: {d!r:.120}")
        ints = [d[k] for k in ("layer", "offset", "nbytes")]
        if any(type(v) is not int or v < 0 for v in ints):
            raise FrameError(f"tensor header: layer, offset, nbytes must be non-negative ints: {d!r:.120}")
        if d["page_kind"] not in PAGE_KINDS or type(d["name"]) is not str or d["dtype"] not in DTYPES:
            raise FrameError(f"tensor header: bad page_kind, name or dtype: {d!r:.120}")
        if d["checksum"] is not None and type(d["checksum"]) is not int:
            raise FrameError(f"tensor header: checksum must be an int or None: {d!r:.120}")
        shape = d["shape"]
        if (
            type(shape) is not list
            or len(shape) > MAX_NDIM
            or any(type(s) is not int or s < 0 for s in shape)
        ):
            raise FrameError(
                f"tensor header: shape must be a list of <= {MAX_NDIM} non-negative ints: {shape!r:.80}"
            )
        itemsize = DTYPES[d["dtype"]].itemsize
        if math.prod(shape) * itemsize != d["nbytes"] or d["nbytes"] > MAX_PAYLOAD_BYTES:
            raise FrameError(f"tensor header: shape {shape} x {itemsize} B != nbytes {d['nbytes']}")
        if d["offset"] != offset:
            raise FrameError(f"tensor header: offset {d['offset']} but the previous tensor ended at {offset}")
        offset += d["nbytes"]
        metas.append(TensorMeta(d))
    if offset != total:
        raise FrameError(f"tensor headers cover {offset} bytes but the p2p message has {total}")
    return metas
