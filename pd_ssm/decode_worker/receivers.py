"""Receivers: the decode worker's receiving connectors, by prefill worker.

ZMQ: one receiver (one PULL socket) takes every prefill worker's pages.  NCCL: a connector pairs
one sender with one receiver, so each prefill worker gets a receiver of its own, made the first
time a Reserve names it (hosting a rendezvous store is immediate; the sender pairs when its first
ticket comes, inside this side's `poll`).  All receivers share one ReservationTable: a ticket is
looked up by request id whichever receiver its pages come through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from pd_ssm.state_transfer.base import Connector
from pd_ssm.state_transfer.reservations import ReservationTable


class Receiver(NamedTuple):
    connector: Connector
    address: str  # the data address tickets name
    rendezvous: str  # "" when the connector pairs with nobody (ZMQ)


# (table) -> receiver bound to a free port
ReceiverFactory = Callable[[ReservationTable], Receiver]


class Receivers:
    """`per_prefill`: one receiver per prefill worker (NCCL) or one for all (ZMQ)."""

    def __init__(self, make: ReceiverFactory, table: ReservationTable, per_prefill: bool) -> None:
        self._make = make
        self.table = table
        self.per_prefill = per_prefill
        self._by_prefill: dict[str, Receiver] = {}

    def for_prefill(self, prefill_id: str) -> Receiver:
        key = prefill_id if self.per_prefill else ""
        rx = self._by_prefill.get(key)
        if rx is None:
            rx = self._by_prefill[key] = self._make(self.table)
        return rx

    def all(self) -> list[Connector]:
        return [r.connector for r in self._by_prefill.values()]

    def close(self) -> None:
        for rx in self._by_prefill.values():
            rx.connector.close()
        self._by_prefill.clear()
