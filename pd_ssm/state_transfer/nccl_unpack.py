"""The receiver's side of the NCCL p2p data message (nccl_message.py): a request's runs part parsed
into checked run headers, and its runs checked against the sums trailer and handed out as views of
the received buffer. Parsing is as strict as wire.py's: every field typed and bounded, no ext types,
and the runs must tile the buffer exactly, in order, so a malformed header can never make the
receiver read outside the bytes it received.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch

from pd_ssm.cache.pages import PageRun, RequestState, StatePages
from pd_ssm.state_transfer.nccl_checksum import PendingSums, align, same_sums, trailer_bytes
from pd_ssm.state_transfer.nccl_memo import Memo
from pd_ssm.state_transfer.nccl_message import _RUN_KEYS, RunMeta, _describe
from pd_ssm.state_transfer.wire import (
    DTYPES,
    MAX_NDIM,
    MAX_PAYLOAD_BYTES,
    PAGE_KINDS,
    FrameError,
    decode_frame,
)
from pd_ssm.state_transfer.wire_fields import unpack as unpack_msgpack

_MAX_META_BYTES = 16 << 20  # the runs list: ~100 B per run plus the layer numbers
# receiver memo: (runs part, start, end) -> its run headers, checked
Headers = Memo[tuple[RunMeta, ...]]
_MEMO_MAX_RAW = 64 << 10  # bytes: a larger runs part is parsed, never memoized (its bytes are the key)


def block_sums_of(buf: torch.Tensor, payload: int) -> tuple[bytes, bytes]:
    """(the block sums of buf[:payload], the trailer's): what `unpack` compares."""
    sums = PendingSums(buf[:payload], buf[payload : payload + trailer_bytes(payload)])
    return sums.wait(), sums.theirs()


def unpack(
    request: RequestState, metas: list[RunMeta], buf: torch.Tensor, device: torch.device,
    sums: tuple[bytes, bytes] | None = None,
) -> StatePages:
    """Compare every run's blocks with the trailer's sums (`sums`: `block_sums_of` the message;
    computed here if None, for a buffer of this one request), then return the runs as views of `buf` (one copy per run if `device`
    differs). The views keep all of `buf` alive, a coalesced message's other requests' bytes too."""
    return StatePages(request, runs=unpack_runs(metas, buf, device, sums))


def unpack_runs(
    metas: list[RunMeta], buf: torch.Tensor, device: torch.device, sums: tuple[bytes, bytes] | None = None
) -> list[PageRun]:
    """`unpack`'s runs, checked, without a request (a part's)."""
    if sums is None:
        sums = block_sums_of(buf, align(metas[-1].offset + metas[-1].nbytes) if metas else 0)
    mine, theirs = sums
    runs: list[PageRun] = []
    for m in metas:
        if not same_sums(mine, theirs, m.offset, m.nbytes):
            raise FrameError(f"checksum mismatch on {m.name!r} of layers {list(m.layers)}: its bytes' block sums "
                             "differ from the sender's")
        stacked = buf[m.offset : m.offset + m.nbytes].view(m.dtype).view(len(m.layers), *m.shape)
        runs.append(PageRun(m.page_kind, m.name, m.layers, stacked.to(device)))
    return runs


def parse_request(header: bytes, payload: bytes, req_id: str) -> RequestState:
    frame = decode_frame(header, payload)
    if frame.kind != "request" or frame.req_id != req_id or frame.body is None:
        raise FrameError(
            f"expected the request frame of {req_id!r}, got a {frame.kind} frame of {frame.req_id!r}"
        )
    return RequestState(**frame.body)


def parse_tensors(raw: bytes, start: int, end: int, memo: Headers | None = None) -> list[RunMeta]:
    """Each run's header, checked: types, dtype, len(layers) x shape x itemsize == nbytes, no layer
    named twice or with two page kinds, and the runs tile [start, end) of the p2p message exactly,
    in order, each at the BLOCK-aligned end of the previous one. Needs no byte of the message: the
    receiver parses while they are still on the link. `memo`: the receiver's; a runs part
    byte-identical to one already checked at the same place takes that one's headers."""
    if memo is None or type(raw) is not bytes or len(raw) > _MEMO_MAX_RAW:
        return _parse_tensors(raw, start, end)
    key = (raw, start, end)
    got = memo.get(key)
    if got is None:
        got = memo.put(key, tuple(_parse_tensors(raw, start, end)))
    return list(got)


def _parse_tensors(raw: bytes, start: int, end: int) -> list[RunMeta]:
    items = unpack_msgpack(raw, _MAX_META_BYTES, "runs part")
    if type(items) is not list:
        raise FrameError(f"runs part must be a msgpack list, got {type(items).__name__}")
    metas, offset = [], start
    by_name: dict[str, set[int]] = {}  # set operations, not a Python loop over 128 tensors
    by_kind: dict[str, set[int]] = {}
    for d in items:
        m = _run_meta(d, offset)
        offset += align(m.nbytes)
        named = by_name.setdefault(m.name, set())
        clash = named.intersection(m.layers)
        for kind, layers in by_kind.items():
            if kind != m.page_kind:
                clash |= layers.intersection(m.layers)
        if clash:
            raise FrameError(f"layers {sorted(clash)}: tensor {m.name!r} repeated or page kinds disagree")
        named.update(m.layers)
        by_kind.setdefault(m.page_kind, set()).update(m.layers)
        metas.append(m)
    if offset != end:
        raise FrameError(f"run headers cover {offset - start} bytes but the request's part of the p2p message has "
                         f"{end - start}")
    return metas


def _run_meta(d: Any, offset: int) -> RunMeta:
    """One run header, checked, expected at `offset`."""
    if not isinstance(d, dict) or set(d) != _RUN_KEYS:
        raise FrameError(f"run header must have exactly the keys {sorted(_RUN_KEYS)}: {d!r:.120}")
    ints = [d[k] for k in ("offset", "nbytes", "checksum")]
    if any(type(v) is not int or v < 0 for v in ints):
        raise FrameError(f"run header: offset, nbytes, checksum must be non-negative ints: {d!r:.120}")
    layers = d["layers"]
    # NOTE: set / sorted run in C: a run header names 64 layers for Mamba2-2.7B, a generator over
    # them costs tens of microseconds a request on the receiver
    if (
        type(layers) is not list
        or not layers
        or set(map(type, layers)) != {int}
        or layers[0] < 0
        or layers != sorted(set(layers))
    ):
        raise FrameError(f"run header: layers must be a non-empty ascending list of layer numbers: {d!r:.120}")
    if d["page_kind"] not in PAGE_KINDS or type(d["name"]) is not str or d["dtype"] not in DTYPES:
        raise FrameError(f"run header: bad page_kind, name or dtype: {d!r:.120}")
    shape = d["shape"]
    if type(shape) is not list or len(shape) > MAX_NDIM or any(type(s) is not int or s < 0 for s in shape):
        raise FrameError(f"run header: shape must be a list of <= {MAX_NDIM} non-negative ints: {shape!r:.80}")
    dtype = DTYPES[d["dtype"]]
    one = math.prod(shape) * dtype.itemsize
    if one > MAX_PAYLOAD_BYTES or len(layers) * one != d["nbytes"]:
        raise FrameError(f"run header: {len(layers)} layers x shape {shape} x {dtype.itemsize} B != nbytes {d['nbytes']}")
    if d["offset"] != offset:
        raise FrameError(f"run header: offset {d['offset']} but the previous run ended at {offset}")
    got = zlib.crc32(_describe(layers, d["page_kind"], d["name"], d["dtype"], shape, offset, d["nbytes"]))
    if got != d["checksum"]:
        raise FrameError(f"checksum mismatch on {d['name']!r} of layers {layers}: header computed {got:#010x}, "
                         f"sent {d['checksum']:#010x}")
    return RunMeta(tuple(layers), d["page_kind"], d["name"], dtype, tuple(shape), offset, d["nbytes"], d["checksum"])
