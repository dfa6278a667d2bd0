"""ZMQ connector fixtures shared by the state-transfer tests: a reservation table, a receiver
bound to a free loopback port, and a sender; each closed after its test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector

TOKEN = "cluster-secret"


@pytest.fixture
def table() -> ReservationTable:
    return ReservationTable(ttl=30.0, token=TOKEN)


@pytest.fixture
def rx(table: ReservationTable) -> Iterator[ZmqConnector]:
    with ZmqConnector(ZmqConfig(TOKEN), bind="tcp://127.0.0.1:0", reservations=table) as c:
        yield c


@pytest.fixture
def tx() -> Iterator[ZmqConnector]:
    with ZmqConnector(ZmqConfig(TOKEN, send_timeout=5.0)) as c:
        yield c
