"""On the receiving side of both connectors, the sender's abort ends a request as a failure of its
own kind (FailureKind.SENDER_ABORTED), a corrupt frame as an ERROR. The decode worker releases the
first silently -- the sender reports its own aborts, and a second report raced the prefill
worker's last token to the router (issue 4: a max_tokens=1 request failed with HTTP 503) -- and
reports the second."""

from __future__ import annotations

import time

import torch

from pd_ssm.cache.pages import StatePages
from pd_ssm.state_transfer.base import FailureKind, TransferFailure
from pd_ssm.state_transfer.ledger import TransferLedger
from pd_ssm.state_transfer.nccl_connector import NcclConnector
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.zmq_connector import ZmqConnector
from tests.state_transfer import test_nccl_connector as nccl
from tests.state_transfer.test_nccl_corruption import _send_mangled_then_good, flip_payload_bit
from tests.state_transfer.test_zmq_connector import _corrupt, _flat, _raw_send, good_request, make_pages


def test_ledger_keeps_the_kind_and_hands_each_failure_out_once() -> None:
    led = TransferLedger()
    led.fail("a", "aborted by the sender", FailureKind.SENDER_ABORTED)
    led.fail("b", "bad frame: checksum mismatch")
    led.fail_anonymous("malformed", "no request named")
    failures = led.take_failures()
    assert failures["a"] == TransferFailure("aborted by the sender", FailureKind.SENDER_ABORTED)
    assert failures["b"] == TransferFailure("bad frame: checksum mismatch", FailureKind.ERROR)
    (anon,) = [k for k in failures if k.startswith("!")]
    assert failures[anon].kind is FailureKind.ERROR
    assert led.take_failures() == {} and led.take_failed() == {}
    led.fail("c", "aborted by the sender", FailureKind.SENDER_ABORTED)
    assert led.take_failed() == {"c": "aborted by the sender"} and led.take_failures() == {}  # reasons only, once


def test_zmq_sender_abort_is_its_own_kind_and_a_corrupt_frame_is_not(
    rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable
) -> None:
    assert rx.address is not None
    pages = make_pages("half", seed=5)
    tx.send_layers(table.reserve("half", rx.address, slot=0), [pages.layers[0]])
    assert tx.flush(2.0)
    assert rx.recv(timeout=0.3) is None and "half" in table  # partly arrived: still reserved
    tx.abort("half")  # the sender's "abort" frame
    table.reserve("bad", rx.address, slot=1)
    _raw_send(rx.address, _corrupt(_flat(make_pages("bad"))))
    failures: dict[str, TransferFailure] = {}
    end = time.monotonic() + 3.0
    while len(failures) < 2 and time.monotonic() < end:
        tx.flush(0)
        assert rx.recv(timeout=0.02) is None
        failures.update(rx.get_failures())
    assert sorted(failures) == ["bad", "half"], failures
    assert failures["half"].kind is FailureKind.SENDER_ABORTED and "aborted by the sender" in failures["half"].reason
    assert failures["bad"].kind is FailureKind.ERROR and "checksum" in failures["bad"].reason
    assert len(table) == 0 and rx.get_failures() == {} and rx.get_failed() == {}
    assert tx.get_failures() == {} and tx.get_finished() == (set(), set())  # the sender's own abort: not a failure
    good_request(rx, tx, table)


def _abort_then_mangled_then_good(tx: NcclConnector) -> None:
    tx.abort("given-up")  # before any byte of it: the receiver releases its reservation now
    _send_mangled_then_good(flip_payload_bit, tx)  # "bad" fails its checksum, "good" arrives


def test_nccl_sender_abort_is_its_own_kind_and_a_corrupt_request_is_not() -> None:
    table = ReservationTable(ttl=60.0, token=nccl.TOKEN)
    nccl.reserve(table, "given-up", "bad", "good")
    good = nccl.make_pages("good", torch.bfloat16, 2)  # what _send_mangled_then_good sends as "good"
    with nccl.pair(table, _abort_then_mangled_then_good) as rx:
        got: dict[str, StatePages] = {}
        failures: dict[str, TransferFailure] = {}
        end = time.monotonic() + 15.0
        while (len(got) < 1 or len(failures) < 2) and time.monotonic() < end:
            p = rx.recv(timeout=0.1)
            if p is not None:
                got[p.req_id] = p
                nccl.assert_same(good, p)
            failures.update(rx.get_failures())
        assert list(got) == ["good"] and sorted(failures) == ["bad", "given-up"], failures
        assert failures["given-up"] == TransferFailure("aborted by the sender", FailureKind.SENDER_ABORTED)
        assert failures["bad"].kind is FailureKind.ERROR and "checksum mismatch" in failures["bad"].reason
        assert rx.get_failures() == {} and rx.paired  # the stream stayed in sync
    assert len(table) == 0

