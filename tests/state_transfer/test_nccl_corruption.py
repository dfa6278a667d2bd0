"""NcclConnector fault tests on gloo: a sender process posts one mangled request "bad" through the
connector's own post path, then a good one. Each mangling must fail "bad" alone -- reported by
`get_failed`, its reservation released -- and "good" must still arrive bit-exact."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch

from pd_ssm.state_transfer.nccl_checksum import BLOCK, align
from pd_ssm.state_transfer.nccl_connector import NcclConnector
from pd_ssm.state_transfer.nccl_control import Control
from pd_ssm.state_transfer.nccl_message import pack, seal
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.wire import encode_request
from tests.state_transfer.test_nccl_connector import (
    TOKEN,
    assert_same,
    collect,
    make_pages,
    only_good_arrives,
    pair,
    reserve,
    ticket,
)

Parts = list[Any]  # [token, control, request header, request payload, tensors]
Mangle = Callable[[Parts, list[dict[str, Any]], torch.Tensor], tuple[Parts, torch.Tensor]]


def _message(tx: NcclConnector, req_id: str) -> tuple[Parts, list[dict[str, Any]], torch.Tensor]:
    """What `send` would post for `req_id`: the parts (tensors part still a list) and the buffer."""
    pages = make_pages(req_id, torch.float32, seed=1)
    buf, metas = pack(pages, torch.device("cpu"))
    header, payload = encode_request(pages.request)
    gen = tx._tx._group.gen  # type: ignore[union-attr]
    size = align(metas[-1]["offset"] + metas[-1]["nbytes"])  # the request's part; its sums trailer follows
    return [TOKEN.encode(), Control.data(gen, [req_id], [size]).encode(), header, payload, None], metas, buf


def _send_mangled_then_good(mangle: Mangle, tx: NcclConnector) -> None:
    parts, metas, buf = _message(tx, "bad")
    parts, buf = mangle(parts, metas, buf)
    if len(parts) == 5 and parts[4] is None:
        parts[4] = msgpack.packb(metas, use_bin_type=True)
    tx._tx.post(["bad"], parts, buf, time.monotonic())  # type: ignore[union-attr]
    tx.send(make_pages("good", torch.bfloat16, seed=2), ticket(tx, "good"))


def flip_payload_bit(parts: Parts, metas: list[dict[str, Any]], buf: torch.Tensor) -> tuple[Parts, torch.Tensor]:
    buf[metas[1]["offset"] + 37] ^= 0x10  # one bit of layer 0's SSM state (the "ssm" run of layers 0, 2)
    return parts, buf


def flip_padding_bit(parts: Parts, metas: list[dict[str, Any]], buf: torch.Tensor) -> tuple[Parts, torch.Tensor]:
    buf[metas[0]["nbytes"] + 3] ^= 0x01  # a gap byte after the "conv" run: on the wire, so checked
    return parts, buf


def claim_more_bytes(parts: Parts, metas: list[dict[str, Any]], buf: torch.Tensor) -> tuple[Parts, torch.Tensor]:
    k = metas[2]  # the "k" run (layer 1), [9, 2, 16]: one row more still ends inside its block padding,
    k["shape"] = [10, 2, 16]  # so only the checksum (over the header too) can tell
    k["nbytes"] = 10 * 2 * 16 * 4
    return parts, buf


def claim_a_block_more(parts: Parts, metas: list[dict[str, Any]], buf: torch.Tensor) -> tuple[Parts, torch.Tensor]:
    end = align(metas[-1]["offset"] + metas[-1]["nbytes"])
    metas.append({**metas[-1], "offset": end, "name": "extra"})  # beyond the request's part
    seal(metas[-1:])
    return parts, buf


def claim_fewer_bytes(parts: Parts, metas: list[dict[str, Any]], buf: torch.Tensor) -> tuple[Parts, torch.Tensor]:
    del metas[-1]
    return parts, buf


def control_claims_more(parts: Parts, metas: list[dict[str, Any]], buf: torch.Tensor) -> tuple[Parts, torch.Tensor]:
    c = msgpack.unpackb(parts[1])  # gloo delivers the shorter message into the larger buffer
    parts[1] = Control.data(c["gen"], c["req_ids"], [c["sizes"][0] + BLOCK]).encode()
    return parts, buf


def shape_disagrees(parts: Parts, metas: list[dict[str, Any]], buf: torch.Tensor) -> tuple[Parts, torch.Tensor]:
    metas[0]["shape"] = [46, 3]
    return parts, buf


def truncate_tensors_part(parts: Parts, metas: list[dict[str, Any]], buf: torch.Tensor) -> tuple[Parts, torch.Tensor]:
    parts[4] = msgpack.packb(metas, use_bin_type=True)[:-9]
    return parts, buf


def truncate_request(parts: Parts, metas: list[dict[str, Any]], buf: torch.Tensor) -> tuple[Parts, torch.Tensor]:
    parts[3] = bytes(parts[3])[:-2]
    return parts, buf


def drop_request_parts(parts: Parts, metas: list[dict[str, Any]], buf: torch.Tensor) -> tuple[Parts, torch.Tensor]:
    parts[4] = msgpack.packb(metas, use_bin_type=True)
    return parts[:2] + parts[4:], buf


def repeat_a_tensor(parts: Parts, metas: list[dict[str, Any]], buf: torch.Tensor) -> tuple[Parts, torch.Tensor]:
    metas[1]["name"] = metas[0]["name"]  # the "ssm" run renamed "conv": a buggy exporter, checksums resealed
    seal(metas)
    return parts, buf


@pytest.mark.parametrize(
    "mangle,reason",
    [
        (flip_payload_bit, "checksum mismatch on 'ssm' of layers [0, 2]"),
        (flip_padding_bit, "checksum mismatch on 'conv' of layers [0, 2]"),
        (claim_more_bytes, "checksum mismatch"),
        (claim_a_block_more, "run headers cover"),
        (claim_fewer_bytes, "run headers cover"),
        (control_claims_more, "run headers cover"),
        (shape_disagrees, "!= nbytes"),
        (truncate_tensors_part, "not valid msgpack"),
        (truncate_request, "truncated"),
        (drop_request_parts, "5 parts"),
        (repeat_a_tensor, "repeated"),
    ],
)
def test_corrupted_request_fails_alone(mangle: Mangle, reason: str) -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "bad", "good")
    with pair(table, functools.partial(_send_mangled_then_good, mangle)) as rx:
        failed = only_good_arrives(rx)
        assert list(failed) == ["bad"] and reason in failed["bad"], failed
        assert rx.get_finished() == (set(), {"good"}) and rx.paired  # the stream stayed in sync
    assert len(table) == 0


def _duplicate_then_good(tx: NcclConnector) -> None:
    pages = make_pages("dup", torch.float32, seed=3)
    tx.send(pages, ticket(tx, "dup"))
    tx.send(pages, ticket(tx, "dup"))
    tx.send(make_pages("good", torch.bfloat16, seed=2), ticket(tx, "good"))
    assert tx.flush(10.0) and tx.get_finished()[0] == {"dup", "good"}


def test_duplicate_request_delivered_once() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "dup", "good")
    with pair(table, _duplicate_then_good) as rx:
        got, failed = collect(rx, 2)
        assert sorted(got) == ["dup", "good"]
        assert_same(make_pages("dup", torch.float32, seed=3), got["dup"])
        assert_same(make_pages("good", torch.bfloat16, seed=2), got["good"])
        time.sleep(0.2)
        _, late = collect(rx, 0, timeout=0.3)
        failed.update(late)
        assert list(failed) == ["dup"] and "no reservation" in failed["dup"]
    assert len(table) == 0


def _truncated_control_then_good(tx: NcclConnector) -> None:
    parts, metas, buf = _message(tx, "bad")
    parts[1] = parts[1][:-3]
    parts[4] = msgpack.packb(metas, use_bin_type=True)
    tx._tx.post(["bad"], parts, buf, time.monotonic())  # type: ignore[union-attr]
    tx.flush(10.0)  # gloo: done once the bytes are in the socket, whatever the receiver did
    end = time.monotonic() + 10.0
    while tx.paired and time.monotonic() < end:  # the receiver could not size it: it drops the pairing
        tx.get_failed()
        time.sleep(0.05)
    assert not tx.paired
    tx.send(make_pages("good", torch.bfloat16, seed=2), ticket(tx, "good"))  # re-pairs first
    assert tx.paired


def test_truncated_control_part_drops_the_pairing_and_the_sender_repairs() -> None:
    table = ReservationTable(ttl=60.0, token=TOKEN)
    reserve(table, "bad", "good")
    with pair(table, _truncated_control_then_good) as rx:
        failed = only_good_arrives(rx)
        assert len(failed) == 1 and next(iter(failed)).startswith("!malformed-")
        assert "bad" in table  # the receiver could not tell whose it was: the sender reported it
        table.cancel("bad")
    assert len(table) == 0
