"""Coalescer: which requests the NCCL sender puts into one data message (nccl_batch.py says why).

Pure bookkeeping, no tensors: the requests `send` took while the link was busy, in order, and
their bytes. Held requests go out as one message as soon as they reach `cap` bytes (`add` returns
them), not when the next one would pass it: a message that waits for one more request leaves the
link idle meanwhile. A request that would take the held bytes past `limit` (what the receiver
takes in one message) first sends the held ones on their way. The sender takes everything held
when the link is idle or at its next call that is not a `send`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_ssm.cache.pages import StatePages


@dataclass(slots=True)
class Queued:
    """A request `send` took and has not posted yet."""

    pages: StatePages
    start: float  # time.monotonic() of its send: its TransferStats count from there
    nbytes: int  # its tensor bytes (what the cap counts)
    parts: int = 0  # its request's parts sent before it (layer-wise streaming)
    part: bool = False  # a part: some layers of the request ahead of its last (no request frame)
    ready: Any = None  # a device event its pages are complete after (None: complete now)
    prior: int = 0  # bytes of its request's parts sent before it (its TransferStats count them)


class Coalescer:
    def __init__(self, cap: int, limit: int | None = None) -> None:
        """`cap`: held bytes that make a message; `limit` (>= cap; None: cap): the most a message
        of several requests may hold."""
        limit = cap if limit is None else limit
        if cap <= 0 or limit < cap:
            raise ValueError(f"coalescing needs 0 < cap <= limit, got cap={cap} limit={limit}")
        self.cap = cap
        self.limit = limit
        self._held: list[Queued] = []
        self._bytes = 0  # NOTE: == sum(q.nbytes for q in self._held)

    def __len__(self) -> int:
        return len(self._held)

    @property
    def req_ids(self) -> list[str]:
        return [q.pages.req_id for q in self._held]

    def add(self, item: Queued) -> list[list[Queued]]:
        """Hold `item`; returns the messages to post now, in order: the requests held before it if
        it would take them past `limit`, then everything held if it reached `cap`."""
        ready = [self.take()] if self._held and self._bytes + item.nbytes > self.limit else []
        self._held.append(item)
        self._bytes += item.nbytes
        if self._bytes >= self.cap:
            ready.append(self.take())
        return ready

    def take(self) -> list[Queued]:
        """Everything held, in order; none is held after."""
        held, self._held, self._bytes = self._held, [], 0
        return held

    def drop(self, req_id: str) -> bool:
        """Forget a held request (aborted before it left); whether it was held."""
        kept = [q for q in self._held if q.pages.req_id != req_id]
        dropped = len(kept) != len(self._held)
        self._held, self._bytes = kept, sum(q.nbytes for q in kept)
        return dropped
