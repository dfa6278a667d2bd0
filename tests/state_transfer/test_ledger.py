"""TransferLedger: each event handed out once; aborts hide a request's later reports."""

from __future__ import annotations

from pd_ssm.state_transfer.base import TransferStats
from pd_ssm.state_transfer.ledger import TransferLedger


def test_take_hands_out_once() -> None:
    led = TransferLedger()
    led.sent(TransferStats("a", 100, 0.5))
    led.received(TransferStats("b", 300, 1.5))
    led.fail("c", "bad frame")
    assert led.take_finished() == ({"a"}, {"b"})
    assert led.take_finished() == (set(), set())
    assert led.take_failed() == {"c": "bad frame"} and led.take_failed() == {}
    stats = led.take_stats()
    assert set(stats) == {"a", "b"} and stats["b"].nbytes == 300 and led.take_stats() == {}


def test_abort_hides_and_is_bounded() -> None:
    led = TransferLedger(max_aborted=3)
    led.fail("x", "late")
    led.abort("x")
    led.sent(TransferStats("x", 1, 1.0))  # a send that completes after the abort is not reported
    assert led.is_aborted("x") and led.take_finished() == (set(), set()) and led.take_failed() == {}
    led.forget_abort("x")
    led.sent(TransferStats("x", 1, 1.0))
    assert led.take_finished() == ({"x"}, set())
    for rid in ("p", "q", "r", "s"):
        led.abort(rid)
    assert not led.is_aborted("p") and led.is_aborted("s")  # the oldest ids fall out first


def test_anonymous_failures_never_name_a_request() -> None:
    led = TransferLedger()
    led.fail_anonymous("unauthenticated", "wrong token")
    led.fail_anonymous("unauthenticated", "wrong token")
    failed = led.take_failed()
    assert len(failed) == 2 and all(k.startswith("!unauthenticated-") for k in failed)
