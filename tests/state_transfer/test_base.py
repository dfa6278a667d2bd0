"""Connector contract helpers: ticket expiry / token, transfer stats."""

from __future__ import annotations

import math
import time

import pytest

from pd_ssm.cache.pages import StatePages
from pd_ssm.state_transfer.base import Connector, Ticket, TransferStats


def ticket(expiry: float, token: str = "s3cret") -> Ticket:
    return Ticket("req-1", "tcp://127.0.0.1:5601", slot=3, block_ids=[4, 9], expiry=expiry, token=token)


def test_ticket_expiry_with_explicit_clock() -> None:
    t = ticket(expiry=100.0)
    assert t.remaining(now=97.5) == pytest.approx(2.5)
    assert not t.expired(now=99.999)
    assert t.expired(now=100.0)  # NOTE: the deadline itself is already too late
    assert t.expired(now=150.0) and t.remaining(now=150.0) == pytest.approx(-50.0)


def test_ticket_expiry_with_monotonic_clock() -> None:
    assert not ticket(expiry=time.monotonic() + 60.0).expired()
    assert ticket(expiry=time.monotonic() - 0.001).expired()
    assert 59.0 < ticket(expiry=time.monotonic() + 60.0).remaining() <= 60.0


def test_ticket_token() -> None:
    t = ticket(expiry=0.0)
    assert t.token_matches("s3cret")
    assert not t.token_matches("s3cre") and not t.token_matches("")


def test_transfer_stats_gbps() -> None:
    assert TransferStats("r", nbytes=2_000_000_000, seconds=0.5).gbps == pytest.approx(4.0)
    assert TransferStats("r", nbytes=168_000_000, seconds=0.001).gbps == pytest.approx(168.0)
    assert TransferStats("r", nbytes=0, seconds=0.0).gbps == 0.0
    assert math.isinf(TransferStats("r", nbytes=1, seconds=0.0).gbps)
    with pytest.raises(ValueError, match="negative"):
        TransferStats("r", nbytes=-1, seconds=1.0)
    with pytest.raises(ValueError, match="negative"):
        TransferStats("r", nbytes=1, seconds=-1.0)


def test_connector_is_abstract_and_poll_is_recv_zero() -> None:
    with pytest.raises(TypeError):
        Connector()  # type: ignore[abstract]

    class Fake(Connector):
        def __init__(self) -> None:
            self.timeouts: list[float | None] = []
            self.closed = 0

        def send(self, pages: StatePages, ticket: Ticket) -> None: ...

        def recv(self, timeout: float | None = None) -> StatePages | None:
            self.timeouts.append(timeout)
            return None

        def get_finished(self) -> tuple[set[str], set[str]]:
            return set(), set()

        def get_failed(self) -> dict[str, str]:
            return {}

        def abort(self, req_id: str) -> None: ...

        def close(self) -> None:
            self.closed += 1

    with Fake() as c:
        assert c.poll() is None
    assert isinstance(c, Fake) and c.timeouts == [0.0] and c.closed == 1
