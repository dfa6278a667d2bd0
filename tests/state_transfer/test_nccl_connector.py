"""NcclConnector on CPU (gloo): the pytest process is the decode side (receiver), a spawned process
the prefill side (sender), which runs one module-level script function. Bit-exact round trips, 64
requests in flight, refusals that each drop one request while the stream stays in sync, and two
connector pairs beside a default process group. The helpers here are shared by the other
test_nccl_* / test_faults_* files."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages
from pd_ssm.state_transfer.base import Ticket
from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector
from pd_ssm.state_transfer.nccl_message import pack
from pd_ssm.state_transfer.nccl_receiver import NcclReceiver
from pd_ssm.state_transfer.reservations import ReservationTable

TOKEN = "cluster-secret"
Script = Callable[[NcclConnector], None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_pages(req_id: str, dtype: torch.dtype = torch.float32, seed: int = 0, ssm_elems: int = 8 * 16 * 16) -> StatePages:
    """Hybrid by hand: SSM layers 0 and 2 (conv in `dtype` with an odd element count, so the buffer
    needs padding before the next tensor), attention layer 1. Random, never zero."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(shape, generator=g) + 3.0).to(dt)

    req = RequestState(req_id, [5, 17, 3, 99, 2, 8, 41, 7, 1], [12], 9, {"temperature": 0.7}, 1234 + seed, 32)
    pages = StatePages(req)
    for layer in (0, 2):
        pages.layers[layer] = LayerPages(layer, "ssm", {"conv": rand(47, 3), "ssm": rand(ssm_elems, dt=torch.float32)})
    pages.layers[1] = LayerPages(1, "attention", {"k": rand(9, 2, 16), "v": rand(9, 2, 16)})
    return pages


def assert_same(a: StatePages, b: StatePages) -> None:
    assert a.request == b.request and sorted(a.layers) == sorted(b.layers)
    for idx, page in a.layers.items():
        other = b.layers[idx]
        assert (page.kind, sorted(page.tensors)) == (other.kind, sorted(other.tensors))
        for name, t in page.tensors.items():
            o = other.tensors[name]
            assert o.device.type == "cpu" and o.dtype == t.dtype and o.shape == t.shape
            assert torch.equal(t.reshape(-1).view(torch.uint8), o.reshape(-1).view(torch.uint8)), (idx, name)


def ticket(tx: NcclConnector, req_id: str) -> Ticket:
    assert tx.address is not None
    return Ticket(req_id, tx.address, slot=0, expiry=time.monotonic() + 60.0, token=TOKEN)


def run_sender(rendezvous: str, script: Script, timeout: float = 15.0) -> None:
    """Child process: pair with the receiver at `rendezvous`, run `script`, check nothing is left."""
    tx = NcclConnector(NcclConfig(TOKEN, rendezvous, timeout=timeout, send_timeout=5.0))
    script(tx)
    assert tx.flush(timeout) and tx.in_flight == 0, tx.get_failed()
    tx.close()
    tx.close()  # idempotent


def receiver(table: ReservationTable, timeout: float = 15.0, recv_window: int = 1 << 30) -> NcclConnector:
    return NcclConnector(
        NcclConfig(TOKEN, "tcp://127.0.0.1:0", timeout=timeout, recv_window=recv_window),
        bind="tcp://127.0.0.1:0", reservations=table,
    )


@contextmanager
def spawned(target: Callable[..., None], *args: object) -> Iterator[mp.process.BaseProcess]:
    """A spawned process; on exit it must have exited 0 (killed if it outlives 15 s)."""
    proc = mp.get_context("spawn").Process(target=target, args=args)
    proc.start()
    try:
        yield proc
        proc.join(15.0)
        assert proc.exitcode == 0, f"peer process exited with {proc.exitcode}"
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


@contextmanager
def pair(table: ReservationTable, script: Script, recv_window: int = 1 << 30) -> Iterator[NcclConnector]:
    """Become the receiver, spawn a sender running `script`; on exit close and check the sender."""
    with receiver(table, recv_window=recv_window) as rx, spawned(run_sender, rx.rendezvous, script):
        assert isinstance(rx, NcclConnector)
        yield rx


def collect(rx: NcclConnector, n: int, timeout: float = 15.0) -> tuple[dict[str, StatePages], dict[str, str]]:
    """Receive until `n` requests arrived (or `timeout`); the pages by id and every failure seen."""
    got: dict[str, StatePages] = {}
    failed: dict[str, str] = {}
    end = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < end:
        p = rx.recv(timeout=0.1)
        if p is not None:
            assert p.req_id not in got, f"{p.req_id} delivered twice"
            got[p.req_id] = p
        failed.update(rx.get_failed())
    failed.update(rx.get_failed())
    return got, failed


def only_good_arrives(rx: NcclConnector) -> dict[str, str]:
    """Exactly one request arrives, "good" (bf16, seed 2), bit-exact; returns the failures seen."""
    got, failed = collect(rx, 1)
    assert list(got) == ["good"], failed
    assert_same(make_pages("good", torch.bfloat16, 2), got["good"])
    return failed


def reserve(table: ReservationTable, *req_ids: str) -> None:
    for r in req_ids:
        table.reserve(r, "unused", slot=0)


# ------------------------------------------------------------------------------------ round trips


def _send_two(tx: NcclConnector) -> None:
    tx.send(make_pages("r32", torch.float32, 7), ticket(tx, "r32"))
    tx.send(make_pages("r16", torch.bfloat16, 8), ticket(tx, "r16"))
    assert tx.flush(10.0)
    assert tx.get_finished()[0] == {"r32", "r16"} and tx.get_failed() == {}


def test_round_trip_bit_exact_fp32_and_bf16() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "r32", "r16")
    with pair(table, _send_two) as rx:
        got, failed = collect(rx, 2)
        assert failed == {} and sorted(got) == ["r16", "r32"]
        assert_same(make_pages("r32", torch.float32, 7), got["r32"])
        assert_same(make_pages("r16", torch.bfloat16, 8), got["r16"])
        stats = rx.get_stats()
        assert stats["r32"].nbytes >= got["r32"].nbytes() > 0  # block padding included
        assert rx.get_finished() == (set(), {"r32", "r16"})
    assert len(table) == 0


def _send_empty_then_full(tx: NcclConnector) -> None:
    empty = make_pages("empty", torch.float32, 3)
    empty.layers = {}  # a request with no cache pages: metadata only, no p2p bytes
    tx.send(empty, ticket(tx, "empty"))
    tx.send(make_pages("full", torch.bfloat16, 4), ticket(tx, "full"))
    assert tx.flush(15.0)
    assert tx.get_finished()[0] == {"empty", "full"} and tx.get_failed() == {}


def test_a_request_without_pages_is_sent_and_reported_in_order() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "empty", "full")
    with pair(table, _send_empty_then_full) as rx:
        got, failed = collect(rx, 2)
        assert failed == {} and got["empty"].layers == {} and got["empty"].request.req_id == "empty"
        assert_same(make_pages("full", torch.bfloat16, 4), got["full"])
    assert len(table) == 0


IN_FLIGHT = 64


def _send_many(tx: NcclConnector) -> None:
    for i in range(IN_FLIGHT):
        tx.send(make_pages(f"m{i}", torch.bfloat16 if i % 2 else torch.float32, i), ticket(tx, f"m{i}"))
    assert tx.in_flight == IN_FLIGHT  # nothing waited: every request is on the wire or held for it
    assert tx.flush(15.0) and tx.in_flight == 0
    assert tx.get_finished()[0] == {f"m{i}" for i in range(IN_FLIGHT)} and tx.get_failed() == {}


@pytest.mark.parametrize("window", ["default", "one message"])
def test_64_requests_in_flight_arrive_exact_and_nothing_leaks(window: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender coalesces requests sent while the link is busy into few messages; the receiver
    posts the next messages' recvs while it checks one (up to recv_window bytes; always at least
    one): exact either way."""
    posted: list[tuple[int, int]] = []  # (bytes, messages) posted each time the receiver acts on a message
    slept: list[bool] = []
    messages: set[int] = set()
    finish = NcclReceiver._finish

    def spy(self: NcclReceiver, item: Any, until: float | None = None) -> Any:
        if item.control.kind == "data" and not slept:
            slept.append(True)
            time.sleep(1.0)  # the sender posts all 64 without waiting for us: they are there after this
        if item.control.kind == "data":
            messages.add(id(item))
        posted.append((self._posted_bytes(), self.in_flight))
        return finish(self, item, until)

    monkeypatch.setattr(NcclReceiver, "_finish", spy)
    one = pack(make_pages("x", torch.float32, 0), torch.device("cpu"))[0].numel()  # a request's p2p bytes
    table = ReservationTable(ttl=60.0, token=TOKEN)
    free_slots = list(range(IN_FLIGHT))  # the decode pool's bookkeeping: free + used == total
    used: dict[str, int] = {}
    for i in range(IN_FLIGHT):
        used[f"m{i}"] = slot = free_slots.pop()
        table.reserve(f"m{i}", "unused", slot)
    with pair(table, _send_many, recv_window=1 << 30 if window == "default" else 1) as rx:
        got, failed = collect(rx, IN_FLIGHT)
        assert rx.in_flight == 0  # every posted recv was handed out
        # the first goes alone (the link was idle), the 63 sent while it was on its way in one message
        assert len(messages) == 2, len(messages)
        assert max(b for b, _ in posted) > 4 * one, posted  # several requests on the link at once
        if window == "one message":
            assert max(n for _, n in posted) == 1  # one message at a time
        assert failed == {} and len(got) == IN_FLIGHT
        for i in range(IN_FLIGHT):
            assert_same(make_pages(f"m{i}", torch.bfloat16 if i % 2 else torch.float32, i), got[f"m{i}"])
            free_slots.append(used.pop(f"m{i}"))  # the request finished decoding
        assert rx.get_finished()[1] == set(got) and rx.recv(timeout=0.1) is None
    assert len(table) == 0 and not used and sorted(free_slots) == list(range(IN_FLIGHT))


# ------------------------------------------------------------------------------------ refusals


def _wrong_token_then_good(tx: NcclConnector) -> None:
    real = tx._tx._token  # type: ignore[union-attr]
    tx._tx._token = b"not-the-token"  # type: ignore[union-attr]  # a misconfigured peer
    tx.send(make_pages("bad", torch.float32, 1), ticket(tx, "bad"))
    tx._tx._token = real  # type: ignore[union-attr]
    tx.send(make_pages("good", torch.bfloat16, 2), ticket(tx, "good"))


def test_wrong_token_refused_then_next_request_works() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "bad", "good")
    with pair(table, _wrong_token_then_good) as rx:
        failed = only_good_arrives(rx)
        assert len(failed) == 1 and next(iter(failed)).startswith("!unauthenticated-")
        assert "bad" in table  # the refused message named it, but unauthenticated: its ticket stays
        table.cancel("bad")
    assert len(table) == 0


def _late_then_next(tx: NcclConnector) -> None:
    tx.send(make_pages("late", torch.float32, 3), ticket(tx, "late"))
    tx.send(make_pages("next", torch.float32, 4), ticket(tx, "next"))


def test_expired_reservation_fails_and_stream_stays_in_sync() -> None:
    now = [0.0]
    table = ReservationTable(ttl=10.0, token=TOKEN, clock=lambda: now[0])
    reserve(table, "late")
    now[0] = 8.0
    reserve(table, "next")  # expires at 18
    now[0] = 11.0  # "late" is past its expiry, "next" is not
    with pair(table, _late_then_next) as rx:
        got, failed = collect(rx, 1)
        assert list(got) == ["next"]
        assert_same(make_pages("next", torch.float32, 4), got["next"])
        assert set(failed) == {"late"} and "expired" in failed["late"]
    assert len(table) == 0


def _three(tx: NcclConnector) -> None:
    for req_id, seed in (("aborted", 5), ("stranger", 6), ("last", 7)):
        tx.send(make_pages(req_id, torch.float32, seed), ticket(tx, req_id))


def test_unknown_and_aborted_requests_are_drained() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "aborted", "last")
    with pair(table, _three) as rx:
        rx.abort("aborted")
        rx.abort("aborted")  # idempotent
        got, failed = collect(rx, 1)
        assert list(got) == ["last"]
        assert_same(make_pages("last", torch.float32, 7), got["last"])
        assert set(failed) == {"stranger"} and "no reservation" in failed["stranger"]
        with pytest.raises(RuntimeError, match="only the rank-0 connector sends"):
            rx.send(make_pages("x"), Ticket("x", "unused", 0, expiry=time.monotonic() + 5))
    assert len(table) == 0


def _sender_aborts(tx: NcclConnector) -> None:
    tx.abort("given-up")  # before any byte of it: the receiver releases its reservation now
    tx.send(make_pages("posted", torch.float32, 8), ticket(tx, "posted"))
    tx.abort("posted")  # too late to stop: delivered, but not reported on this side
    tx.send(make_pages("good", torch.bfloat16, 9), ticket(tx, "good"))
    assert tx.flush(10.0)
    assert tx.get_finished()[0] == {"good"} and tx.get_failed() == {}


def test_abort_on_the_sending_side() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "given-up", "posted", "good")
    with pair(table, _sender_aborts) as rx:
        got, failed = collect(rx, 2)
        assert sorted(got) == ["good", "posted"]
        assert_same(make_pages("good", torch.bfloat16, 9), got["good"])
        assert failed == {"given-up": "aborted by the sender"}
    assert len(table) == 0
