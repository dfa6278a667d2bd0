"""ReservationTable: pure bookkeeping, driven by an injected clock."""

from __future__ import annotations

import pytest

from pd_ssm.state_transfer.reservations import ReservationTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reserve_issues_ticket_and_lookup() -> None:
    clock = Clock()
    table = ReservationTable(ttl=2.0, token="tok", clock=clock)
    t = table.reserve("a", "tcp://127.0.0.1:1", slot=3, block_ids=[4, 5])
    assert (t.req_id, t.address, t.slot, t.block_ids, t.expiry, t.token) == (
        "a",
        "tcp://127.0.0.1:1",
        3,
        [4, 5],
        102.0,
        "tok",
    )
    assert table.get("a") is t and "a" in table and len(table) == 1
    assert table.get("b") is None and "b" not in table
    assert table.is_live("a")
    clock.now = 102.0
    assert not table.is_live("a") and table.get("a") is t  # expired but not yet collected


def test_duplicate_reservation_raises() -> None:
    table = ReservationTable(ttl=1.0, clock=Clock())
    table.reserve("a", "addr", 0)
    with pytest.raises(ValueError, match="already holds"):
        table.reserve("a", "addr", 1)
    assert len(table) == 1 and table.get("a") is not None and table.get("a").slot == 0  # type: ignore[union-attr]


def test_expire_returns_and_forgets_only_lapsed() -> None:
    clock = Clock()
    table = ReservationTable(ttl=1.0, clock=clock)
    table.reserve("a", "addr", 0)
    clock.now += 0.5
    table.reserve("b", "addr", 1, [7])
    assert table.expire() == []
    clock.now += 0.5  # a's expiry exactly: lapsed
    gone = table.expire()
    assert [t.req_id for t in gone] == ["a"] and "a" not in table and "b" in table
    assert [t.req_id for t in table.expire(now=clock.now + 10)] == ["b"]
    assert len(table) == 0 and table.expire() == []


def test_complete_and_cancel() -> None:
    table = ReservationTable(ttl=1.0, clock=Clock())
    table.reserve("a", "addr", 0)
    table.reserve("b", "addr", 1)
    assert table.complete("a").slot == 0
    with pytest.raises(KeyError, match="no reservation"):
        table.complete("a")
    assert table.cancel("b") is not None
    assert table.cancel("b") is None and table.cancel("never") is None  # idempotent
    assert len(table) == 0
    table.reserve("a", "addr", 2)  # a finished id may be reserved again
    assert table.get("a").slot == 2  # type: ignore[union-attr]


def test_bad_ttl() -> None:
    with pytest.raises(ValueError, match="ttl"):
        ReservationTable(ttl=0.0)
