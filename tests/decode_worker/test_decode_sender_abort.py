"""The decode role releases a reservation whose sender aborted it without reporting a failed
transfer -- the prefill worker reports its own aborts, and a report from the decode worker could
reach the router before a request's last token and fail it (issue 4: HTTP 503 "aborted by the
sender" on a max_tokens=1 request) -- while a real failure (a corrupt frame) is still reported."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd_ssm.control.disagg_messages import ReserveReply, ReserveRequest, TransferReport
from pd_ssm.decode_worker.role import DecodeRole
from pd_ssm.prefill_worker.role import ticket_of
from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector
from tests.decode_worker.test_disagg_roles import TOKEN, _clean, _decode_role, _engine
from tests.state_transfer.test_zmq_connector import _corrupt, _flat, _raw_send, make_pages


@pytest.fixture
def sent() -> list[Any]:
    return []


@pytest.fixture
def decode(model_dir: Path, sent: list[Any]) -> Iterator[DecodeRole]:
    role = _decode_role(_engine(model_dir, 2), ttl=30.0)  # nothing here may end by expiry
    role.start(sent.append)
    yield role
    role.close()


def test_sender_abort_releases_silently_a_corrupt_frame_is_reported(decode: DecodeRole, sent: list[Any]) -> None:
    cache = decode.engine.cache
    for rid in ("quit", "bad"):
        decode.handle(ReserveRequest(rid, "p0", 40))
    tickets = {m.req_id: m.ticket for m in sent if isinstance(m, ReserveReply)}
    quit_spec, bad_spec = tickets["quit"], tickets["bad"]
    assert quit_spec is not None and bad_spec is not None and cache.num_free_slots == 0
    sent.clear()
    with ZmqConnector(ZmqConfig(TOKEN)) as tx:
        pages = make_pages("quit", seed=5)
        tx.send_layers(ticket_of(quit_spec), [pages.layers[0]])
        assert tx.flush(2.0)
        end = time.monotonic() + 0.3
        while time.monotonic() < end:  # its first layer is in: still reserved, nothing reported
            decode.progress()
        assert "quit" in decode.engine.reserved and not sent
        tx.abort("quit")  # as a prefill worker whose request ended at its first token
        _raw_send(bad_spec.address, _corrupt(_flat(make_pages("bad"))), token=TOKEN)
        end = time.monotonic() + 3.0
        while decode.pending() and time.monotonic() < end:
            tx.flush(0)
            decode.progress()
    (report,) = [m for m in sent if isinstance(m, TransferReport)]  # none for "quit"
    assert report.req_id == "bad" and not report.ok and "checksum" in report.error
    assert [m for m in sent if not isinstance(m, TransferReport)] == []
    # NOTE: _clean runs the pools' check (free + used == total) and asks for none used
    assert _clean(decode.engine) and cache.num_free_slots == 2 and len(decode.table) == 0
