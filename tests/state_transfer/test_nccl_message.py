"""The NCCL connector's coalesced buffer and block-sum checksums, in one process: layout (runs of
same-named tensors over the layers), views, and that every byte on the wire and every header field
is covered."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch

from pd_ssm.cache.pages import LayerPages, PageRun, StatePages
from pd_ssm.state_transfer.nccl_checksum import BLOCK, align, block_sums, trailer_bytes
from pd_ssm.state_transfer.nccl_control import Control, parse_control
from pd_ssm.state_transfer.nccl_message import pack, plan
from pd_ssm.state_transfer.nccl_unpack import parse_tensors, unpack
from pd_ssm.state_transfer.wire import FrameError
from tests.state_transfer.test_nccl_connector import assert_same, make_pages


def test_pack_aligns_every_run_and_unpack_returns_views() -> None:
    pages = make_pages("r", torch.bfloat16, seed=11)
    buf, metas = pack(pages, torch.device("cpu"))
    assert [(m["name"], m["layers"]) for m in metas] == [("conv", [0, 2]), ("ssm", [0, 2]), ("k", [1]), ("v", [1])]
    payload = sum(align(m["nbytes"]) for m in metas)
    assert buf.numel() % BLOCK == 0 and all(m["offset"] % BLOCK == 0 for m in metas)
    assert buf.numel() == payload + trailer_bytes(payload)
    assert buf[payload : payload + payload // BLOCK * 8].numpy().tobytes() == block_sums(buf[:payload])  # the trailer
    got = unpack(pages.request, parse_tensors(msgpack.packb(metas), 0, payload), buf, torch.device("cpu"))
    assert_same(pages, got)
    ssm = got.layers[2].tensors["ssm"]
    assert ssm.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view, no copy
    gap = buf[metas[0]["nbytes"] : align(metas[0]["nbytes"])]
    assert gap.numel() > 0 and not gap.any()  # padding is zeros, so both sides sum the same


def _stacked_pages(seed: int) -> StatePages:
    """5 SSM layers' pages as per-layer views of two stacked tensors (what export_pages' runs give)."""
    g = torch.Generator().manual_seed(seed)
    conv, ssm = torch.randn(5, 6, 3, generator=g), torch.randn(5, 2, 4, 8, generator=g)
    return StatePages(make_pages("s", torch.float32, seed).request,
                      runs=[PageRun("ssm", "conv", (0, 1, 2, 3, 4), conv), PageRun("ssm", "ssm", (0, 1, 2, 3, 4), ssm)])


def test_per_layer_views_of_one_tensor_are_laid_out_as_one_view() -> None:
    """Evenly spaced slices of one allocation go to the batched copy as one strided view, no stack;
    anything else (separate tensors, slices out of order or overlapping) is stacked. Same bytes."""
    pages = _stacked_pages(31)
    expect = [r.stacked.clone() for r in pages.runs or []]
    _ = pages.layers  # per-layer views from now on
    sources = plan([pages]).sources[0]
    assert all(isinstance(s, torch.Tensor) for s in sources)
    assert all(torch.equal(s, e) for s, e in zip(sources, expect, strict=True))
    assert sources[1].data_ptr() == pages.layers[0].tensors["ssm"].data_ptr()  # a view, not a copy
    buf, metas = pack(pages, torch.device("cpu"))
    assert_same(pages, unpack(pages.request, parse_tensors(msgpack.packb(metas), 0, _payload(metas)), buf,
                              torch.device("cpu")))

    apart = _stacked_pages(32)
    apart.layers[3].tensors["conv"] = apart.layers[3].tensors["conv"].clone()  # its own allocation
    cut = apart.layers[2].tensors["ssm"]
    apart.layers[2].tensors["ssm"] = cut.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, not contiguous
    conv, ssm = plan([apart]).sources[0]
    assert isinstance(conv, list) and isinstance(ssm, list)
    buf, metas = pack(apart, torch.device("cpu"))
    assert_same(apart, unpack(apart.request, parse_tensors(msgpack.packb(metas), 0, _payload(metas)), buf,
                              torch.device("cpu")))

    overlapping = make_pages("o", torch.float32, 33)
    window = torch.randn(4, 6, 3, generator=torch.Generator().manual_seed(33))
    flat = window.reshape(-1)
    overlapping.layers = {i: LayerPages(i, "ssm", {"conv": flat[9 * i : 9 * i + 18].view(6, 3)}) for i in range(3)}
    (src,) = plan([overlapping]).sources[0]
    assert isinstance(src, list)  # 18 values, 9 apart: each overlaps the next


def _payload(metas: list[dict[str, Any]]) -> int:
    """The bytes of a one-request buffer before its sums trailer."""
    return align(metas[-1]["offset"] + metas[-1]["nbytes"])


def test_a_flipped_byte_or_a_mangled_trailer_fails_its_run_only() -> None:
    pages = make_pages("r", torch.float32, seed=15)
    buf, metas = pack(pages, torch.device("cpu"))
    runs = parse_tensors(msgpack.packb(metas), 0, _payload(metas))
    bad = buf.clone()
    bad[metas[2]["offset"] + 5] ^= 0x01  # a byte of the "k" run
    with pytest.raises(FrameError, match="checksum mismatch on 'k'"):
        unpack(pages.request, runs, bad, torch.device("cpu"))
    bad = buf.clone()
    bad[_payload(metas) + 8 * (metas[1]["offset"] // BLOCK)] ^= 0x01  # the sender's sum of the "ssm" run's first block
    with pytest.raises(FrameError, match="checksum mismatch on 'ssm'"):
        unpack(pages.request, runs, bad, torch.device("cpu"))
    assert_same(pages, unpack(pages.request, runs, buf, torch.device("cpu")))


def test_block_sums_are_exact_integers() -> None:
    g = torch.Generator().manual_seed(5)
    buf = torch.randint(0, 256, (3 * BLOCK,), dtype=torch.uint8, generator=g)
    sums = block_sums(buf)
    words = buf.view(torch.int32).view(3, -1).to(torch.int64)  # the reference: plain int64 math
    assert sums == words.sum(dim=1).numpy().astype("<i8").tobytes()
    buf[BLOCK + 7] ^= 0x80  # one bit in the middle block changes that block's sum, no other
    again = block_sums(buf)
    assert again[:8] == sums[:8] and again[8:16] != sums[8:16] and again[16:] == sums[16:]
    with pytest.raises(ValueError, match="multiple of"):
        block_sums(buf[:100])


@pytest.mark.parametrize(
    "field,value", [("layers", [0, 3]), ("name", "k"), ("dtype", "float16"), ("shape", [47, 3])]
)
def test_checksum_covers_the_run_header(field: str, value: object) -> None:
    pages = make_pages("r", torch.bfloat16, seed=12)
    buf, metas = pack(pages, torch.device("cpu"))
    meta = metas[0]  # "conv" of layers 0 and 2, bf16 [47, 3]
    if field == "shape":
        meta["shape"], meta["dtype"] = [47, 3, 1], "bfloat16"  # same bytes, another shape
    else:
        meta[field] = value
    with pytest.raises(FrameError, match="checksum mismatch"):
        unpack(pages.request, parse_tensors(msgpack.packb(metas), 0, _payload(metas)), buf, torch.device("cpu"))


def test_control_part_is_strict() -> None:
    c = Control.data(3, ["r1", "r2"], [2 * BLOCK, 0])
    assert parse_control(c.encode()) == c and c.nbytes == 2 * BLOCK
    assert parse_control(Control.hello(2).encode()) == Control.hello(2)
    assert parse_control(Control.abort(2, "r1").encode()).req_id == "r1"
    streamed = Control.data(3, ["r1", "r2"], [BLOCK, BLOCK], [4, 0])  # r1's layers came in 4 parts before
    assert parse_control(streamed.encode()).parts == (4, 0)
    for bad in (
        Control.data(0, ["r1"], [BLOCK]).encode(),  # generations start at 1
        Control.data(1, ["r1"], [BLOCK + 1]).encode(),  # a request's part is whole blocks
        Control.data(1, ["r1", "r2"], [BLOCK]).encode(),  # one size per request
        Control.data(1, [], []).encode(),  # a data message carries a request
        Control("data", 1, ("r1",), (BLOCK,), ()).encode(),  # one part count per request
        Control("data", 1, ("r1",), (BLOCK,), (-1,)).encode(),
        Control("abort", 1, ("r1",), (BLOCK,), (0,)).encode(),  # an abort carries no bytes
        Control("abort", 1, ("r1",), (0,), (1,)).encode(),  # only a data message counts parts
        Control("hello", 1, ("r1",), (0,), (0,)).encode(),
        Control("shout", 1, ("r1",), (0,), (0,)).encode(),
        msgpack.packb({"kind": "data", "gen": 1, "req_ids": ["r1"], "parts": [0]}),
        msgpack.packb({"kind": "data", "gen": 1, "req_ids": [1], "sizes": [0], "parts": [0]}),
        msgpack.packb({"kind": "data", "gen": 1, "req_ids": ["r1"], "sizes": [0]}),  # no part counts
        c.encode()[:-2],
    ):
        with pytest.raises(FrameError):
            parse_control(bad)


@pytest.mark.parametrize(
    "edit",
    [
        {"layers": []},  # a run of no layer
        {"layers": [2, 0]},  # not ascending: a layer could come twice
        {"layers": [0, 0]},
        {"layers": [0, 2, 3]},  # more layers than its bytes hold
        {"layers": "02"},
    ],
)
def test_run_layers_are_checked(edit: dict[str, object]) -> None:
    pages = make_pages("r", torch.float32, seed=13)
    buf, metas = pack(pages, torch.device("cpu"))
    metas[0].update(edit)
    with pytest.raises(FrameError, match="layers"):
        parse_tensors(msgpack.packb(metas), 0, _payload(metas))


def test_a_layer_claimed_by_two_runs_is_refused() -> None:
    pages = make_pages("r", torch.float32, seed=14)
    buf, metas = pack(pages, torch.device("cpu"))
    metas[3]["name"] = "k"  # "v" of layer 1 renamed: layer 1 would get "k" twice
    from pd_ssm.state_transfer.nccl_message import seal

    seal(metas)  # a consistent sender bug, not line noise: the checksums agree
    with pytest.raises(FrameError, match="repeated"):
        unpack(pages.request, parse_tensors(msgpack.packb(metas), 0, _payload(metas)), buf, torch.device("cpu"))
