"""StreamOut: the NCCL sender's bookkeeping of requests streamed layer by layer -- the layers held
for each request's next part, the parts it has made, and the requests whose stream broke.

Pure bookkeeping over the pages handed in (no device work, no sockets). A request's layers become a
part once they reach `stream_bytes`; its final send takes the layers still held and the count of
parts made. A stream breaks when a part of it cannot go (peer lost, a dtype the wire refuses) or
the request is aborted: its failure is reported once, then its later layers and its final send
are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages


@dataclass(slots=True)
class _Held:
    layers: list[LayerPages] = field(default_factory=list)
    nbytes: int = 0
    parts: int = 0
    ready: Any = None  # the latest device event of the held layers (NOTE: recorded in order: it covers them all)
    sent: int = 0  # bytes of the parts made
    start: float = field(default_factory=time.monotonic)  # its first layers came


class Part(NamedTuple):
    pages: StatePages
    ready: Any  # a device event the part's layers are complete after, or None (host pages)
    nbytes: int  # its layers' tensor bytes


class Finished(NamedTuple):
    layers: list[LayerPages]  # held, not sent in a part: they go with the final send
    parts: int  # parts made before it
    ready: Any = None  # as Part's, for those layers
    sent: int = 0  # bytes of those parts
    start: float | None = None  # time.monotonic() its first layers came; None: it did not stream
    nbytes: int = 0  # tensor bytes of `layers`


_MAX_BROKEN = 1 << 16  # broken streams remembered: an aborted request's final send may never come


class StreamOut:
    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self._broken: dict[str, None] = {}  # insertion-ordered: the oldest is forgotten first

    def is_broken(self, req_id: str) -> bool:
        return req_id in self._broken

    def add(self, req_id: str, layers: Sequence[LayerPages], stream_bytes: int, ready: Any = None,
            flush: bool = False) -> Part | None:
        """Hold `layers` of `req_id` (complete once `ready` is, if given); the part to send if they
        now reach `stream_bytes`, or with `flush` if any are held.
        NOTE: called once per layer per request (64 times for a 2.7B request): kept lean."""
        held = self._held.get(req_id)
        if held is None:
            held = self._held[req_id] = _Held()
        held.layers += layers
        for page in layers:
            held.nbytes += page.nbytes()
        if ready is not None:
            held.ready = ready
        if held.nbytes < stream_bytes and not (flush and held.layers):
            return None
        part = Part(StatePages(_carrier(req_id), layers={p.layer_idx: p for p in held.layers}), held.ready, held.nbytes)
        held.sent += held.nbytes
        held.layers, held.nbytes, held.ready = [], 0, None
        held.parts += 1
        return part

    def finish(self, req_id: str) -> Finished | None:
        """The request's final send: what is left of its stream (none if it never streamed), or
        None if its stream broke (the send is dropped; its failure was reported then)."""
        if req_id in self._broken:
            del self._broken[req_id]
            return None
        held = self._held.pop(req_id, None)
        if held is None:
            return Finished([], 0)
        return Finished(held.layers, held.parts, held.ready, held.sent, held.start, held.nbytes)

    def break_(self, req_id: str) -> None:
        """Its stream broke: what is held goes, and its later layers and final send are dropped."""
        self._held.pop(req_id, None)
        self._mark(req_id)

    def abort(self, req_id: str) -> None:
        """Aborted by the caller: a streamed request's final send (if the engine still makes it) goes nowhere."""
        if self._held.pop(req_id, None) is not None:
            self._mark(req_id)

    def _mark(self, req_id: str) -> None:
        self._broken[req_id] = None
        if len(self._broken) > _MAX_BROKEN:
            del self._broken[next(iter(self._broken))]

    def with_parts(self) -> list[str]:
        """Requests with parts made (on the current pairing, which a lost peer takes with it)."""
        return [req_id for req_id, held in self._held.items() if held.parts]


def _carrier(req_id: str) -> RequestState:
    """A part's pages need a RequestState only for their request id (its frame is not sent)."""
    return RequestState(req_id, [], [], 0, {}, 0, 0)
