"""NcclConnector's own process groups: two connector pairs between the same two processes beside
a default torch.distributed group, pairing that finds no receiver, and config checks."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from pd_ssm.cache.pages import StatePages
from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector
from pd_ssm.state_transfer.reservations import ReservationTable
from tests.state_transfer.test_nccl_connector import (
    TOKEN,
    assert_same,
    free_port,
    make_pages,
    receiver,
    reserve,
    run_sender,
    spawned,
    ticket,
)


def _two_senders_beside_a_default_group(rv_a: str, rv_b: str, store_port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=0, world_size=1)
    try:
        a = NcclConnector(NcclConfig(TOKEN, rv_a, timeout=15.0))
        b = NcclConnector(NcclConfig(TOKEN, rv_b, timeout=15.0))
        for i in range(3):  # interleaved: each pair's stream is its own
            a.send(make_pages(f"a{i}", torch.float32, i), ticket(a, f"a{i}"))
            b.send(make_pages(f"b{i}", torch.bfloat16, 10 + i), ticket(b, f"b{i}"))
        assert a.flush(10.0) and b.flush(10.0)
        t = torch.full((4,), 2.5)
        dist.all_reduce(t)  # the default group is untouched
        assert torch.equal(t, torch.full((4,), 2.5))
        a.close()
        b.close()
    finally:
        dist.destroy_process_group()


def test_two_connector_pairs_between_two_processes_beside_a_default_group() -> None:
    table_a, table_b = ReservationTable(ttl=60.0, token=TOKEN), ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table_a, "a0", "a1", "a2")
    reserve(table_b, "b0", "b1", "b2")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with receiver(table_a) as rx_a, receiver(table_b) as rx_b:
            assert isinstance(rx_a, NcclConnector) and isinstance(rx_b, NcclConnector)
            with spawned(_two_senders_beside_a_default_group, rx_a.rendezvous, rx_b.rendezvous, free_port()):
                got: dict[str, StatePages] = {}
                end = time.monotonic() + 15.0
                while len(got) < 6 and time.monotonic() < end:
                    for rx in (rx_a, rx_b):  # both receivers' loops run: each pairs on its own hello
                        p = rx.recv(timeout=0.05)
                        if p is not None:
                            got[p.req_id] = p
            assert rx_a.get_failed() == {} and rx_b.get_failed() == {}
        assert sorted(got) == ["a0", "a1", "a2", "b0", "b1", "b2"]
        for i in range(3):
            assert_same(make_pages(f"a{i}", torch.float32, i), got[f"a{i}"])
            assert_same(make_pages(f"b{i}", torch.bfloat16, 10 + i), got[f"b{i}"])
        assert dist.is_initialized() and dist.get_world_size() == 1  # ours, still there
    finally:
        dist.destroy_process_group()
    assert len(table_a) == 0 and len(table_b) == 0


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="token"):
        NcclConfig("", "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="tcp://host:port"):
        NcclConfig(TOKEN, "env://")
    assert NcclConfig(TOKEN, "tcp://127.0.0.1:1").backend == "gloo"
    assert NcclConfig(TOKEN, "tcp://127.0.0.1:1", device="cuda:0").backend == "nccl"
    with pytest.raises(ValueError, match="both"):
        NcclConnector(NcclConfig(TOKEN, "tcp://127.0.0.1:0"), bind="tcp://127.0.0.1:0")


def test_sender_without_receiver_fails_loudly_and_quickly() -> None:
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="pairing with the receiver"):
        NcclConnector(NcclConfig(TOKEN, f"tcp://127.0.0.1:{free_port()}", timeout=1.0))
    assert time.monotonic() - t0 < 5.0


def _good_after_the_pairing_broke(tx: NcclConnector) -> None:
    time.sleep(1.0)  # the receiver meanwhile reads the oversized message and drops our pairing
    end = time.monotonic() + 10.0
    while tx.paired and time.monotonic() < end:
        tx.get_failed()  # reaps: the store says the pairing was dropped
        time.sleep(0.05)
    assert not tx.paired
    tx.send(make_pages("good", torch.bfloat16, 2), ticket(tx, "good"))  # pairs again first


def test_a_message_too_large_to_take_drops_the_pairing_not_the_receiver() -> None:
    """A data message of the live generation asking for more than max_message_bytes (a forged or
    broken sender): nothing is allocated for it, the pairing goes (its bytes could not be taken
    and the stream would misalign), and the sender's next request goes through a new pairing."""
    import zmq

    from pd_ssm.state_transfer.nccl_control import Control

    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "good")
    rx = NcclConnector(NcclConfig(TOKEN, "tcp://127.0.0.1:0", timeout=15.0, max_message_bytes=1 << 20),
                       bind="tcp://127.0.0.1:0", reservations=table)
    with rx, spawned(run_sender, rx.rendezvous, _good_after_the_pairing_broke):
        end = time.monotonic() + 15.0
        while not rx.paired and time.monotonic() < end:
            assert rx.recv(timeout=0.05) is None
        gen = rx._rx._gen  # type: ignore[union-attr]
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(rx.address or "")
        push.send_multipart([b"forged", Control.data(gen, ["huge"], [1 << 40]).encode()])
        got = None
        failed: dict[str, str] = {}
        while got is None and time.monotonic() < end + 15.0:
            got = rx.recv(timeout=0.1)
            failed.update(rx.get_failed())
        push.close(linger=0)
        ctx.term()
        assert got is not None and got.req_id == "good"
        assert_same(make_pages("good", torch.bfloat16, 2), got)
        assert any("unauthenticated" in k for k in failed), failed
    assert len(table) == 0
