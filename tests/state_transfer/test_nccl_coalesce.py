"""NcclConnector coalescing on gloo (nccl_batch.py): requests sent while the link is busy travel as
one p2p message, each still checked, failed or aborted on its own; a lone request is not held.
The pytest process receives; a spawned process sends (helpers from test_nccl_connector)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pd_ssm.state_transfer.nccl_batch import OutMessage, build
from pd_ssm.state_transfer.nccl_coalesce import Queued
from pd_ssm.state_transfer.nccl_config import NcclConfig
from pd_ssm.state_transfer.nccl_connector import NcclConnector
from pd_ssm.state_transfer.nccl_control import Control
from pd_ssm.state_transfer.nccl_receiver import NcclReceiver
from pd_ssm.state_transfer.reservations import ReservationTable
from tests.state_transfer.test_nccl_connector import (
    TOKEN,
    assert_same,
    collect,
    make_pages,
    pair,
    receiver,
    reserve,
    spawned,
    ticket,
)

SIBLINGS = ["s0", "s1", "s2", "s3"]
DTYPES = [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]


def sibling(i: int) -> Any:
    return make_pages(SIBLINGS[i], DTYPES[i], seed=40 + i)


@pytest.fixture
def messages(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """The request ids of every data message the receiver reads, in order."""
    seen: list[tuple[str, ...]] = []
    read = NcclReceiver._read

    def spy(self: NcclReceiver, msg: list[bytes]) -> Any:
        item = read(self, msg)
        if item is not None and item.control.kind == "data":
            seen.append(item.control.req_ids)
        return item

    monkeypatch.setattr(NcclReceiver, "_read", spy)
    return seen


def _lead_then_siblings(tx: NcclConnector, after: Callable[[NcclConnector], None] | None = None) -> None:
    """"lead" finds the link idle and leaves at once; the siblings, sent while it is on its way
    (gloo: until a flush), are held for one message."""
    tx.send(make_pages("lead", torch.float32, seed=39), ticket(tx, "lead"))
    assert not tx._tx._held and tx.in_flight == 1  # type: ignore[union-attr]  # posted, not held
    for i in range(len(SIBLINGS)):
        tx.send(sibling(i), ticket(tx, SIBLINGS[i]))
    assert len(tx._tx._held) == len(SIBLINGS) and tx.in_flight == 1 + len(SIBLINGS)  # type: ignore[union-attr]
    if after is not None:
        after(tx)
    assert tx.flush(10.0) and tx.in_flight == 0


def _siblings_then_lone(tx: NcclConnector) -> None:
    _lead_then_siblings(tx)
    assert tx.get_finished()[0] == {"lead", *SIBLINGS} and tx.get_failed() == {}
    tx.send(make_pages("lone", torch.bfloat16, seed=50), ticket(tx, "lone"))  # the link is idle again
    assert not tx._tx._held and len(tx._tx._pending) == 1  # type: ignore[union-attr]


def test_requests_sent_while_the_link_is_busy_share_one_message(messages: list[tuple[str, ...]]) -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "lead", *SIBLINGS, "lone")
    with pair(table, _siblings_then_lone) as rx:
        got, failed = collect(rx, 2 + len(SIBLINGS))
        assert failed == {} and messages == [("lead",), tuple(SIBLINGS), ("lone",)]
        for i, req_id in enumerate(SIBLINGS):
            assert_same(sibling(i), got[req_id])
        assert_same(make_pages("lone", torch.bfloat16, seed=50), got["lone"])
        stats = rx.get_stats()
        assert all(stats[r].nbytes >= got[r].nbytes() > 0 for r in SIBLINGS)  # each its own part, padding included
    assert len(table) == 0


def _capped_sender(rendezvous: str) -> None:
    fp32 = [make_pages(req_id, torch.float32, seed=40 + i) for i, req_id in enumerate(SIBLINGS)]
    tx = NcclConnector(NcclConfig(TOKEN, rendezvous, timeout=15.0, send_timeout=5.0,
                                  coalesce_bytes=2 * fp32[0].nbytes()))  # two requests a message
    tx.send(make_pages("lead", torch.float32, seed=39), ticket(tx, "lead"))
    for pages in fp32:
        tx.send(pages, ticket(tx, pages.req_id))
    assert tx.flush(10.0) and tx.get_failed() == {}
    tx.close()


def test_a_message_holds_at_most_coalesce_bytes(messages: list[tuple[str, ...]]) -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "lead", *SIBLINGS)
    with receiver(table) as rx, spawned(_capped_sender, rx.rendezvous):
        assert isinstance(rx, NcclConnector)
        got, failed = collect(rx, 1 + len(SIBLINGS))
        assert failed == {} and messages == [("lead",), ("s0", "s1"), ("s2", "s3")]
    assert len(table) == 0


# ------------------------------------------------------------------------------------ faults


def _flip_payload(parts: list[Any], batch: OutMessage) -> str:
    assert batch.buf is not None
    batch.buf[batch.sizes[0] + 37] ^= 0x10  # a byte of s1's first run, after the sums went into the trailer
    return "checksum mismatch"


def _truncate_request(parts: list[Any], batch: OutMessage) -> str:
    parts[2 + 3 + 1] = bytes(parts[2 + 3 + 1])[:-2]  # s1's request payload
    return "truncated"


def _runs_elsewhere(parts: list[Any], batch: OutMessage) -> str:
    parts[2 + 3 + 2] = parts[2 + 2]  # s1 sent with s0's run headers: they lie outside s1's part
    return "offset"


def _mangled_sibling(mangle: Callable[[list[Any], OutMessage], str]) -> Callable[[NcclConnector], None]:
    def script(tx: NcclConnector) -> None:
        assert tx._tx is not None and tx._tx._group is not None
        queued = [Queued(sibling(i), time.monotonic(), sibling(i).nbytes()) for i in range(3)]
        out = build(queued, tx._tx._group.gen, TOKEN.encode())
        buf = out.lay_out(torch.device("cpu"))  # its sums trailer written
        mangle(out.parts, out)
        tx._tx.post(out.req_ids, out.parts, buf, time.monotonic())
        tx.send(make_pages("good", torch.bfloat16, seed=2), ticket(tx, "good"))

    return script


def _script_flip(tx: NcclConnector) -> None:
    _mangled_sibling(_flip_payload)(tx)


def _script_truncate(tx: NcclConnector) -> None:
    _mangled_sibling(_truncate_request)(tx)


def _script_elsewhere(tx: NcclConnector) -> None:
    _mangled_sibling(_runs_elsewhere)(tx)


@pytest.mark.parametrize(
    "script,reason",
    [(_script_flip, "checksum mismatch"), (_script_truncate, "truncated"), (_script_elsewhere, "offset")],
)
def test_a_corrupt_request_fails_alone_among_its_siblings(script: Callable[[NcclConnector], None], reason: str) -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "s0", "s1", "s2", "good")
    with pair(table, script) as rx:
        got, failed = collect(rx, 3)
        assert sorted(got) == ["good", "s0", "s2"], failed
        assert list(failed) == ["s1"] and reason in failed["s1"], failed
        assert_same(sibling(0), got["s0"])
        assert_same(sibling(2), got["s2"])
        assert_same(make_pages("good", torch.bfloat16, seed=2), got["good"])
        assert rx.paired  # the stream stayed in sync
    assert len(table) == 0


def test_abort_of_one_request_in_a_message_on_the_receiving_side(messages: list[tuple[str, ...]]) -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "lead", *SIBLINGS)
    with pair(table, _lead_then_siblings) as rx:
        rx.abort("s2")
        got, failed = collect(rx, len(SIBLINGS))
        assert sorted(got) == ["lead", "s0", "s1", "s3"] and failed == {}  # s2 dropped silently
        assert messages == [("lead",), tuple(SIBLINGS)]
        for i in (0, 1, 3):
            assert_same(sibling(i), got[SIBLINGS[i]])
    assert len(table) == 0


def _abort_a_held_one(tx: NcclConnector) -> None:
    tx.abort("s1")  # still held: it never leaves; the others go out now


def _sender_aborts_a_held_sibling(tx: NcclConnector) -> None:
    _lead_then_siblings(tx, _abort_a_held_one)
    assert tx.get_finished()[0] == {"lead", "s0", "s2", "s3"} and tx.get_failed() == {}


def test_abort_of_a_held_request_on_the_sending_side(messages: list[tuple[str, ...]]) -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "lead", *SIBLINGS)
    with pair(table, _sender_aborts_a_held_sibling) as rx:
        got, failed = collect(rx, len(SIBLINGS))
        assert rx.recv(timeout=0.5) is None  # the abort comes after the message: acted on here
        failed.update(rx.get_failed())
        assert sorted(got) == ["lead", "s0", "s2", "s3"]
        assert failed == {"s1": "aborted by the sender"}
        assert messages == [("lead",), ("s0", "s2", "s3")]
    assert len(table) == 0


BIG = 6 << 20  # fp32 elements per SSM page: 2 layers x 24 MB a request


def _dies_mid_message(rendezvous: str) -> None:
    """Dies once the two-request message's metadata is out and its recv posted, before its bytes:
    killed while laying the buffer out. (A 5 ms sleep after posting, as before, raced the link on
    a loaded CI host: the whole message sometimes landed first.)"""
    from pd_ssm.state_transfer import nccl_batch

    def die(*args: Any) -> Any:
        time.sleep(0.5)  # "lead", posted alone before, lands meanwhile
        os.kill(os.getpid(), signal.SIGKILL)

    tx = NcclConnector(NcclConfig(TOKEN, rendezvous, timeout=10.0))
    tx.send(make_pages("lead", torch.float32, seed=39), ticket(tx, "lead"))
    for req_id in ("big1", "big2"):
        tx.send(make_pages(req_id, seed=60, ssm_elems=BIG), ticket(tx, req_id))  # held: the link is busy
    assert tx.in_flight == 3 and len(tx._tx._held) == 2  # type: ignore[union-attr]
    nccl_batch.fill = die
    tx.get_finished()  # not a send: posts the held two as one message -- and dies laying it out


def _sends_after(tx: NcclConnector) -> None:
    tx.send(make_pages("after", torch.bfloat16, seed=3), ticket(tx, "after"))


def test_sender_killed_mid_message_fails_every_request_of_it(messages: list[tuple[str, ...]]) -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "lead", "big1", "big2", "after")
    with receiver(table, timeout=5.0) as rx:
        assert isinstance(rx, NcclConnector)
        proc = mp.get_context("spawn").Process(target=_dies_mid_message, args=(rx.rendezvous,))
        proc.start()
        got, failed = collect(rx, 1)
        end = time.monotonic() + 8.0
        while len(failed) < 2 and time.monotonic() < end:  # within the receiver's 5 s timeout
            assert rx.recv(timeout=0.1) is None
            failed.update(rx.get_failed())
        proc.join(5.0)
        assert proc.exitcode == -signal.SIGKILL
        assert list(got) == ["lead"] and messages == [("lead",), ("big1", "big2")]
        assert sorted(failed) == ["big1", "big2"], failed
        assert all("peer lost mid-transfer" in why for why in failed.values()), failed
        assert "big1" not in table and "big2" not in table and not rx.paired
    with pair(table, _sends_after) as rx2:  # a fresh receiver serves the same table
        got, failed = collect(rx2, 1)
        assert list(got) == ["after"] and not failed
    assert len(table) == 0


def test_a_data_message_names_each_request_and_its_size() -> None:
    c = Control.data(4, ["a", "b"], [1 << 16, 2 << 16])
    assert (c.nbytes, c.req_ids, c.sizes) == (3 << 16, ("a", "b"), (1 << 16, 2 << 16))


def _layout_fails_after_its_metadata(tx: NcclConnector) -> None:
    """The buffer cannot be laid out (device memory) once the metadata is out: the receiver waits
    for bytes that will not come, so the pairing goes and both requests fail; the next re-pairs."""
    from pd_ssm.state_transfer import nccl_batch

    fill = nccl_batch.fill

    def oom(*args: Any) -> Any:
        nccl_batch.fill = fill  # once
        raise RuntimeError("CUDA out of memory (simulated)")

    tx.send(make_pages("lead", torch.float32, seed=39), ticket(tx, "lead"))
    assert tx.flush(10.0) and tx.get_finished()[0] == {"lead"}
    tx.send(make_pages("lead2", torch.float32, seed=38), ticket(tx, "lead2"))  # in flight: it fails with the pairing
    nccl_batch.fill = oom
    for i in range(2):
        tx.send(sibling(i), ticket(tx, SIBLINGS[i]))  # held
    tx.flush(10.0)  # posts them: metadata out, then the layout fails
    failed = tx.get_failed()
    assert sorted(failed) == ["lead2", "s0", "s1"] and all("cannot lay out" in why for why in failed.values()), failed
    assert not tx.paired and tx.in_flight == 0
    tx.send(make_pages("good", torch.bfloat16, seed=2), ticket(tx, "good"))  # re-pairs first
    assert tx.paired


def test_a_message_that_cannot_be_laid_out_fails_its_requests_and_the_sender_repairs() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "lead", "lead2", "s0", "s1", "good")
    with pair(table, _layout_fails_after_its_metadata) as rx:
        got, failed = collect(rx, 2)
        while "good" not in got and len(got) < 3:  # "lead2" may have made it before the pairing went
            more, why = collect(rx, 1)
            got.update(more)
            failed.update(why)
        got.pop("lead2", None)
        failed.pop("lead2", None)
        table.cancel("lead2")  # the sender reported it failed either way: the decode side lets it go
        assert sorted(got) == ["good", "lead"]
        # NOTE: the receiver either notices the dropped pairing while it waits for their bytes
        # ("peer lost") or before it reads their metadata (sent on a generation that is gone)
        assert sorted(failed) == ["s0", "s1"] and all(
            "peer lost" in why or "which is gone" in why for why in failed.values()
        ), failed
        assert_same(make_pages("good", torch.bfloat16, seed=2), got["good"])
    assert len(table) == 0
