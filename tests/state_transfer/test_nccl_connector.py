"""NcclConnector on CPU (gloo): the pytest process is the decode rank, a spawned process the prefill
rank. Bit-exact round trips, a sequence of requests, and refusals (wrong token, expired, aborted)
that each drop one request while the p2p stream stays in sync for the next."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages
from pd_ssm.state_transfer.base import Ticket
from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector
from pd_ssm.state_transfer.reservations import ReservationTable

TOKEN = "cluster-secret"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Script = list[tuple[str, str, int, str]]  # (req_id, dtype name, seed, token the sender presents)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_pages(req_id: str, dtype: torch.dtype, seed: int) -> StatePages:
    """Hybrid by hand: SSM layers 0 and 2 (conv in `dtype` with an odd element count, so the fp32
    SSM state after it sits at an unaligned offset of the coalesced buffer), attention layer 1."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(shape, generator=g) + 3.0).to(dt)  # never zero

    req = RequestState(req_id, [5, 17, 3, 99, 2, 8, 41, 7, 1], [12], 9, {"temperature": 0.7}, 1234 + seed, 32)
    pages = StatePages(req)
    for layer in (0, 2):
        pages.layers[layer] = LayerPages(
            layer, "ssm", {"conv": rand(47, 3), "ssm": rand(8, 16, 16, dt=torch.float32)}
        )
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


def _sender(init_method: str, address: str, script: Script) -> None:
    """The prefill rank: send each scripted request, wait for every p2p send, close."""
    tx = NcclConnector(NcclConfig(TOKEN, init_method, timeout=20.0))
    for req_id, dtype, seed, token in script:
        tx._token = token.encode()  # a misconfigured peer presents another token
        ticket = Ticket(req_id, address, slot=0, expiry=time.monotonic() + 60.0, token=TOKEN)
        tx.send(make_pages(req_id, DTYPES[dtype], seed), ticket)
    assert tx.flush(20.0), "p2p sends did not complete"
    sent, _ = tx.get_finished()
    assert sent == {r for r, *_ in script}, sent
    assert tx.get_failed() == {}
    tx.close()
    tx.close()  # idempotent


@contextmanager
def pair(script: Script, table: ReservationTable) -> Iterator[NcclConnector]:
    """Spawn the sender, become the receiver; on exit close and check the sender succeeded."""
    init_method, address = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = mp.get_context("spawn").Process(target=_sender, args=(init_method, address, script))
    proc.start()
    try:
        rx = NcclConnector(NcclConfig(TOKEN, init_method, timeout=20.0), bind=address, reservations=table)
        try:
            yield rx
        finally:
            rx.close()
            rx.close()  # idempotent
        proc.join(20.0)
        assert proc.exitcode == 0, f"sender exited with {proc.exitcode}"
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


def reserve(table: ReservationTable, *req_ids: str) -> None:
    for r in req_ids:
        table.reserve(r, "unused", slot=0)


def test_round_trip_bit_exact_fp32_and_bf16() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "r32", "r16")
    with pair([("r32", "float32", 7, TOKEN), ("r16", "bfloat16", 8, TOKEN)], table) as rx:
        for req_id, dtype, seed in (("r32", torch.float32, 7), ("r16", torch.bfloat16, 8)):
            got = rx.recv(timeout=20.0)
            assert got is not None
            assert_same(make_pages(req_id, dtype, seed), got)
            assert rx.get_stats()[req_id].nbytes == got.nbytes() > 0
        assert rx.get_finished() == (set(), {"r32", "r16"})
        assert rx.get_failed() == {}
    assert len(table) == 0


def test_sixteen_requests_in_sequence() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    script = [(f"q{i}", "bfloat16" if i % 2 else "float32", i, TOKEN) for i in range(16)]
    reserve(table, *(r for r, *_ in script))
    with pair(script, table) as rx:
        for req_id, dtype, seed, _ in script:
            got = rx.recv(timeout=20.0)
            assert got is not None and got.req_id == req_id
            assert_same(make_pages(req_id, DTYPES[dtype], seed), got)
        assert rx.get_finished()[1] == {r for r, *_ in script}
        assert rx.get_failed() == {}
    assert len(table) == 0


def test_wrong_token_refused_then_next_request_works() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "bad", "good")
    with pair([("bad", "float32", 1, "not-the-token"), ("good", "bfloat16", 2, TOKEN)], table) as rx:
        got = rx.recv(timeout=20.0)
        assert got is not None and got.req_id == "good"
        assert_same(make_pages("good", torch.bfloat16, 2), got)
        failed = rx.get_failed()
        assert len(failed) == 1 and next(iter(failed)).startswith("!unauthenticated-")
        assert "bad" in table  # the refused message named it, but unauthenticated: its ticket stays
        table.cancel("bad")
    assert len(table) == 0


def test_expired_reservation_fails_and_stream_stays_in_sync() -> None:
    now = [0.0]
    table = ReservationTable(ttl=10.0, token=TOKEN, clock=lambda: now[0])
    reserve(table, "late")
    now[0] = 8.0
    reserve(table, "next")  # expires at 18
    now[0] = 11.0  # "late" is past its expiry, "next" is not
    with pair([("late", "float32", 3, TOKEN), ("next", "float32", 4, TOKEN)], table) as rx:
        got = rx.recv(timeout=20.0)
        assert got is not None and got.req_id == "next"
        assert_same(make_pages("next", torch.float32, 4), got)
        failed = rx.get_failed()
        assert set(failed) == {"late"} and "expired" in failed["late"]
    assert len(table) == 0


def test_unknown_and_aborted_requests_are_drained() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "aborted", "last")
    script = [
        ("aborted", "float32", 5, TOKEN),
        ("stranger", "bfloat16", 6, TOKEN),
        ("last", "float32", 7, TOKEN),
    ]
    with pair(script, table) as rx:
        rx.abort("aborted")
        rx.abort("aborted")  # idempotent
        got = rx.recv(timeout=20.0)
        assert got is not None and got.req_id == "last"
        assert_same(make_pages("last", torch.float32, 7), got)
        failed = rx.get_failed()
        assert set(failed) == {"stranger"} and "no reservation" in failed["stranger"]
        with pytest.raises(RuntimeError, match="only the rank-0 connector sends"):
            rx.send(make_pages("x", torch.float32, 0), Ticket("x", "unused", 0, expiry=time.monotonic() + 5))
    assert len(table) == 0


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="token"):
        NcclConfig("", "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="init_method"):
        NcclConfig(TOKEN, "env://")
    assert NcclConfig(TOKEN, "tcp://127.0.0.1:1").backend == "gloo"
    assert NcclConfig(TOKEN, "tcp://127.0.0.1:1", device="cuda:0").backend == "nccl"
