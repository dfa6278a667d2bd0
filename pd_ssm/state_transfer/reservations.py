"""ReservationTable: the decode side's live Tickets, one per request awaiting its pages.

Pure bookkeeping: no sockets, no tensors. The caller reserves a state slot and KV blocks in its
own pools first, then records the reservation here and forwards the Ticket; a connector looks the
ticket up when pages arrive. Every ticket leaves the table exactly once, through `complete`
(pages arrived), `cancel` (abort / failed transfer) or `expire` (nothing came in time), and the
caller frees the slot / blocks of tickets that left through `cancel` or `expire`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pd_ssm.state_transfer.base import Ticket


class ReservationTable:
    """Live tickets by request id. `clock` is injectable for tests (seconds, monotonic)."""

    def __init__(self, ttl: float, token: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl > 0:
            raise ValueError(f"reservation ttl must be > 0 seconds, got {ttl}")
        self.ttl = ttl
        self.token = token  # put in every ticket; the sender presents its own cluster token
        self.clock = clock
        self._live: dict[str, Ticket] = {}

    def reserve(self, req_id: str, address: str, slot: int, block_ids: list[int] | None = None) -> Ticket:
        """Record a reservation the caller made in its pools; the ticket expires `ttl` s from now."""
        if req_id in self._live:
            raise ValueError(
                f"request {req_id!r} already holds a reservation (slot {self._live[req_id].slot})"
            )
        ticket = Ticket(req_id, address, slot, list(block_ids or []), self.clock() + self.ttl, self.token)
        self._live[req_id] = ticket
        return ticket

    def get(self, req_id: str) -> Ticket | None:
        """The ticket of `req_id` if it is still in the table (it may have expired: see `is_live`)."""
        return self._live.get(req_id)

    def is_live(self, req_id: str, now: float | None = None) -> bool:
        ticket = self._live.get(req_id)
        return ticket is not None and not ticket.expired(self.clock() if now is None else now)

    def expire(self, now: float | None = None) -> list[Ticket]:
        """Remove and return every ticket whose expiry has passed; the caller frees their slot / blocks."""
        now = self.clock() if now is None else now
        gone = [t for t in self._live.values() if t.expired(now)]
        for t in gone:
            del self._live[t.req_id]
        return gone

    def complete(self, req_id: str) -> Ticket:
        """The pages of `req_id` arrived: the reservation becomes the request's (KeyError if unknown)."""
        try:
            return self._live.pop(req_id)
        except KeyError:
            raise KeyError(
                f"request {req_id!r} holds no reservation (expired, cancelled or never made)"
            ) from None

    def cancel(self, req_id: str) -> Ticket | None:
        """Drop the reservation of `req_id` (abort, failed transfer); idempotent, None if unknown."""
        return self._live.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._live
