"""Wire frames: bit-exact round trips, and every inconsistency rejected with FrameError (only)."""

from __future__ import annotations

import gc
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages, runs_of
from pd_ssm.state_transfer import wire, wire_fields
from pd_ssm.state_transfer.assembler import PageAssembler, frames_to_pages
from pd_ssm.state_transfer.checksum import gather_sums, sum_share, sum_shares
from pd_ssm.state_transfer.wire import (
    Frame,
    FrameError,
    decode_frame,
    encode_end,
    encode_page,
    encode_request,
    encode_run,
    finish_frame,
    pages_to_frames,
    parse_frame,
)


def rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random, never-zero values (so a dropped or zeroed page cannot pass)."""
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=gen, dtype=torch.float32) + 3.0
        return x.to(dtype)
    hi = 255 if dtype == torch.uint8 else 2**31 - 1
    return torch.randint(1, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def make_pages(req_id: str = "req-1", dtype: torch.dtype = torch.float32, seed: int = 0) -> StatePages:
    """A hybrid request by hand: SSM layers 0, 2 and attention layer 1 (KV of 7 tokens)."""
    g = torch.Generator().manual_seed(seed)
    req = RequestState(
        req_id=req_id,
        prompt_token_ids=[5, 17, 3, 99, 2, 8, 41],
        output_token_ids=[12],
        num_computed_tokens=7,
        params={"temperature": 0.7, "top_p": 0.9, "stop": ["\n\n"], "logit_bias": None},
        seed=1234,
        max_tokens=32,
        prompt="hello",
    )
    pages = StatePages(req)
    for layer in (0, 2):
        pages.layers[layer] = LayerPages(
            layer, "ssm", {"conv": rand((48, 3), dtype, g), "ssm": rand((8, 16, 16), torch.float32, g)}
        )
    pages.layers[1] = LayerPages(1, "attention", {"k": rand((7, 2, 16), dtype, g), "v": rand((7, 2, 16), dtype, g)})
    return pages


def assert_pages_equal(a: StatePages, b: StatePages) -> None:
    assert a.request == b.request
    assert sorted(a.layers) == sorted(b.layers)
    for idx, page in a.layers.items():
        other = b.layers[idx]
        assert (page.layer_idx, page.kind, sorted(page.tensors)) == (other.layer_idx, other.kind, sorted(other.tensors))
        for name, t in page.tensors.items():
            assert same_bits(t, other.tensors[name]), (idx, name)


def header_of(parts: list[Any]) -> dict[str, Any]:
    h: dict[str, Any] = msgpack.unpackb(parts[0], raw=False)
    return h


def repack(h: dict[str, Any], fix_checksum: bool = True, payload: Any = b"") -> bytes:
    h = dict(h)
    if fix_checksum:
        h["checksum"] = wire._checksum(h, payload)
    return msgpack.packb(h, use_bin_type=True)


# ------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (4, 6, 3)])
def test_page_round_trip_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = rand(shape, dtype, torch.Generator().manual_seed(len(shape)))
    header, payload = encode_page("r", 3, "ssm", "ssm", t)
    f = decode_frame(bytes(header), bytes(payload))
    assert (f.kind, f.req_id, f.layer_idx, f.page_kind, f.name, f.body) == ("page", "r", 3, "ssm", "ssm", None)
    assert f.tensor is not None and same_bits(f.tensor, t) and f.tensor.is_contiguous()


def test_special_float_bits_survive() -> None:
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40], dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = t.to(dtype)
        f = decode_frame(*encode_page("r", 0, "ssm", "x", x))
        assert f.tensor is not None and same_bits(f.tensor, x)


def test_payload_is_zero_copy_and_keeps_staging_alive() -> None:
    t = rand((8, 4), torch.bfloat16, torch.Generator().manual_seed(1))
    _, payload = encode_page("r", 0, "ssm", "x", t)
    t.view(torch.int16)[0, 0] += 1  # the payload views t's memory: no copy on the send path
    assert bytes(payload)[:2] == bits(t)[:2].numpy().tobytes()

    nc = rand((6, 10), torch.float32, torch.Generator().manual_seed(2)).t()  # non-contiguous
    expect = nc.clone()
    header, payload = encode_page("r", 0, "attention", "k", nc)
    del nc
    gc.collect()
    _ = [torch.full((60,), 7.0) for _ in range(50)]  # reuse freed memory if it were freed
    f = decode_frame(header, payload)
    assert f.tensor is not None and same_bits(f.tensor, expect)


def test_decoded_tensor_owns_memory() -> None:
    t = rand((16,), torch.float32, torch.Generator().manual_seed(3))
    header, payload = encode_page("r", 0, "ssm", "x", t)
    buf = bytearray(payload)
    f = decode_frame(header, memoryview(buf))
    buf[:] = b"\x00" * len(buf)  # receive buffer reused
    assert f.tensor is not None and same_bits(f.tensor, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_receive_without_copy_views_a_writable_buffer(dtype: torch.dtype) -> None:
    """copy=False (a connector's receive path): the tensor views the received buffer and keeps it
    alive; a read-only buffer (bytes) is still copied."""
    t = rand((5, 7), dtype, torch.Generator().manual_seed(4))
    header, payload = encode_page("r", 0, "ssm", "x", t)
    buf = bytearray(payload)
    f = decode_frame(header, memoryview(buf), copy=False)
    assert f.tensor is not None and same_bits(f.tensor, t) and f.tensor.shape == t.shape
    buf[0] ^= 0xFF  # the same memory: a change to the buffer shows in the tensor
    assert not same_bits(f.tensor, t)
    del buf
    gc.collect()
    assert f.tensor.view(torch.uint8).reshape(-1)[1:].numpy().tobytes() == bytes(payload)[1:]  # still alive
    frozen = decode_frame(header, bytes(payload), copy=False)
    assert frozen.tensor is not None and same_bits(frozen.tensor, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_state_pages_round_trip(dtype: torch.dtype) -> None:
    pages = make_pages(dtype=dtype, seed=7)
    frames = pages_to_frames(pages)
    # request, conv and ssm runs of SSM layers 0 and 2, k and v pages of attention layer 1, end
    assert [header_of(f)["kind"] for f in frames] == ["request", "run", "run", "page", "page", "end"]
    assert all(len(f) == 2 for f in frames)
    assert_pages_equal(pages, frames_to_pages(frames, expected_layers=[0, 1, 2]))
    # through real bytes, as a socket would deliver them
    assert_pages_equal(pages, frames_to_pages([[bytes(h), bytes(p)] for h, p in frames]))


def test_non_contiguous_pages_round_trip() -> None:
    pages = make_pages(seed=3)
    pages.layers[1].tensors["k"] = pages.layers[1].tensors["k"].transpose(0, 1)  # [2, 7, 16] strided
    pages.layers[0].tensors["conv"] = torch.randn(3, 48).add(2.0).t()
    assert not pages.layers[1].tensors["k"].is_contiguous()
    assert_pages_equal(pages, frames_to_pages(pages_to_frames(pages)))


def test_layerwise_order_any_order_before_end() -> None:
    pages = make_pages()
    frames = pages_to_frames(pages)
    body, end = frames[1:-1], frames[-1]
    shuffled = [*reversed(body), frames[0], end]  # pages as layers finish, request frame last
    asm = PageAssembler(expected_layers=[0, 1, 2])
    done = [asm.add(decode_frame(h, p)) for h, p in shuffled]
    assert done == [False] * (len(frames) - 1) + [True]
    assert_pages_equal(pages, asm.result())


def test_encode_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="dtype"):
        encode_page("r", 0, "ssm", "x", torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="page kind"):
        encode_page("r", 0, "kv", "x", torch.ones(2))
    with pytest.raises(ValueError, match="CPU"):
        encode_page("r", 0, "ssm", "x", torch.ones(2, device="meta"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize(("layers", "shape"), [((0, 1), (4, 6, 3)), ((3, 5, 9, 60), (48, 3)), ((2, 7), (0,)), ((4,), (5,))])
def test_run_round_trip_bit_exact(dtype: torch.dtype, layers: tuple[int, ...], shape: tuple[int, ...]) -> None:
    stacked = rand((len(layers), *shape), dtype, torch.Generator().manual_seed(len(layers)))
    header, payload = encode_run("r", layers, "ssm", "ssm", stacked)
    h = header_of([header])
    assert (h["kind"], h["layers"], h["shape"]) == ("run", list(layers), list(shape))
    for buf, copy in ((bytes(payload), True), (memoryview(bytearray(payload)), False)):
        f = decode_frame(header, buf, copy=copy)
        assert (f.kind, f.req_id, f.layer_idx, f.layers, f.page_kind, f.name) == ("run", "r", None, layers, "ssm", "ssm")
        assert f.tensor is not None and same_bits(f.tensor, stacked)


def test_run_pages_round_trip_as_runs() -> None:
    """Pages that come as runs (export_pages) go as run frames and arrive as runs again, views of
    the frames' payloads, so an import can take the fast path; per-layer views are the same bits."""
    pages = make_pages(seed=11)
    as_runs = StatePages(pages.request, runs=runs_of(pages.layers))
    frames = pages_to_frames(as_runs)
    got = frames_to_pages([[h, memoryview(bytearray(p))] for h, p in frames])
    assert got.runs is not None and [(r.kind, r.name, r.layers) for r in got.runs] == [
        ("ssm", "conv", (0, 2)), ("ssm", "ssm", (0, 2)), ("attention", "k", (1,)), ("attention", "v", (1,))
    ]
    assert_pages_equal(pages, got)


def test_parse_then_finish_with_piece_sums() -> None:
    """A receiver may sum pieces of a payload in a pool (checksum.sum_shares) and finish the frame
    from their sums: the same frame as decode_frame, and a piece of wrong bytes still fails."""
    stacked = rand((6, 3 * 4096 + 40), torch.uint8, torch.Generator().manual_seed(8))  # 73 KB a layer
    header, payload = encode_run("r", [1, 2, 3, 4, 5, 6], "attention", "k", stacked)
    parsed = parse_frame(header, bytes(payload))
    shares = sum_shares([parsed.payload.nbytes], 3, min_piece=4096)
    assert len(shares) == 3
    sums = gather_sums(1, shares, [sum_share([parsed.payload], share) for share in shares])[0]
    f = finish_frame(parsed, sums)
    assert f == decode_frame(header, payload)._replace(tensor=f.tensor) and same_bits(f.tensor, stacked)
    bad = bytearray(payload)
    bad[5 * 4096 + 3] ^= 0x10  # in the second piece
    parsed = parse_frame(header, bytes(bad))
    sums = gather_sums(1, shares, [sum_share([parsed.payload], share) for share in shares])[0]
    with pytest.raises(FrameError, match=r"checksum mismatch on layers \[1, 2, 3, 4, 5, 6\] 'k'"):
        finish_frame(parsed, sums)


# ----------------------------------------------------------------------------- rejections


def page_parts(dtype: torch.dtype = torch.float32) -> list[Any]:
    return encode_page("r", 1, "ssm", "ssm", rand((4, 5), dtype, torch.Generator().manual_seed(9)))


def test_bad_checksum_payload_bit_flip() -> None:
    header, payload = page_parts()
    bad = bytearray(payload)
    bad[7] ^= 0x01
    with pytest.raises(FrameError, match="checksum mismatch"):
        decode_frame(header, bytes(bad))


def _flip_bits(payload: Any, header: bytes, positions: list[int]) -> None:
    """Every single-bit flip at `positions` (bit indices into the payload) fails the checksum."""
    raw = bytes(payload)
    for bit in positions:
        bad = bytearray(raw)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FrameError, match="checksum mismatch"):
            decode_frame(header, bytes(bad))


def test_checksum_catches_any_single_bit_flip() -> None:
    # 2 whole 4 KiB blocks and a tail of 7 bytes: the last block (and word) is zero-padded
    t = rand((2 * 4096 + 7,), torch.uint8, torch.Generator().manual_seed(3))
    header, payload = encode_page("r", 0, "attention", "k", t)
    nbits = len(bytes(payload)) * 8
    tail = list(range((2 * 4096) * 8, nbits))  # every bit of the partial block, incl. the padded word
    word = list(range(4096 * 8, 4096 * 8 + 32))  # one whole int32 word, its sign bit too
    edges = [b for blk in (0, 1) for b in (blk * 4096 * 8, (blk + 1) * 4096 * 8 - 1)]
    sample = torch.randint(0, nbits, (256,), generator=torch.Generator().manual_seed(4)).tolist()
    _flip_bits(payload, header, tail + word + edges + sample)


def test_checksum_catches_swapped_blocks() -> None:
    t = rand((3, 1024), torch.float32, torch.Generator().manual_seed(5))  # 3 blocks of 4 KiB
    header, payload = encode_page("r", 0, "ssm", "ssm", t)
    raw = bytes(payload)
    swapped = raw[2 * 4096 :] + raw[4096 : 2 * 4096] + raw[:4096]
    assert swapped != raw
    with pytest.raises(FrameError, match="checksum mismatch"):
        decode_frame(header, swapped)


def test_checksum_covers_header_identity() -> None:
    header, payload = page_parts()
    h = header_of([header])
    h["layer"] = 2  # still a valid header, but it names the wrong layer
    with pytest.raises(FrameError, match="checksum mismatch"):
        decode_frame(repack(h, fix_checksum=False), payload)


def test_bad_length_and_truncation() -> None:
    header, payload = page_parts()
    with pytest.raises(FrameError, match="truncated"):
        decode_frame(header, bytes(payload)[:-3])
    with pytest.raises(FrameError, match="payload has"):
        decode_frame(header, bytes(payload) + b"\x00")
    with pytest.raises(FrameError, match="no payload"):
        decode_frame(header, None)
    with pytest.raises(FrameError, match="not valid msgpack"):
        decode_frame(header[:-5], payload)  # truncated header


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("magic", b"XXXX", "bad magic"),
        ("magic", "PDSM", "bad magic"),
        ("version", 1, "unsupported frame version"),  # a peer of the crc32-only wire
        ("version", 2, "unsupported frame version"),  # a peer without run frames
        ("version", 4, "unsupported frame version"),
        ("version", True, "unsupported frame version"),
        ("kind", "pages", "unknown frame kind"),
        ("dtype", "float64", "not allowed"),
        ("dtype", "object", "not allowed"),
        ("page_kind", "kv", "unknown page kind"),
        ("shape", [4, 4], r"shape \[4, 4\] x 4 B"),
        ("shape", [4, -5], "non-negative"),
        ("shape", [4, 5.0], "non-negative"),
        ("shape", "4,5", "shape must be a list"),
        ("shape", [1] * 9, "at most 8"),
        ("shape", [2**31, 2**31], "over the cap"),
        ("nbytes", 2**40, "payload has"),
        ("nbytes", -1, ">= 0"),
        ("layer", -1, ">= 0"),
        ("layer", "1", "must be int"),
        ("layer", True, "must be int"),
        ("req_id", b"r", "must be str"),
        ("name", None, "must be str"),
        ("checksum", 1.5, "must be int"),
    ],
)
def test_bad_header_field(field: str, value: Any, match: str) -> None:
    header, payload = page_parts()
    h = header_of([header])
    h[field] = value
    with pytest.raises(FrameError, match=match):
        decode_frame(repack(h, fix_checksum=field != "checksum", payload=payload), payload)


def run_parts(layers: tuple[int, ...] = (0, 2, 5), dtype: torch.dtype = torch.float32) -> list[Any]:
    return encode_run("r", layers, "ssm", "ssm", rand((len(layers), 4, 5), dtype, torch.Generator().manual_seed(9)))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("layers", [], "1 to"),
        ("layers", [0, 2], r"2 layers x shape \[4, 5\] x 4 B \(float32\) != nbytes 240"),
        ("layers", [0, 2, 5, 6], r"4 layers x shape"),
        ("layers", [2, 0, 5], "ascending"),
        ("layers", [0, 0, 5], "ascending"),
        ("layers", [0, -2, 5], "non-negative ints"),
        ("layers", [0, 2.0, 5], "non-negative ints"),
        ("layers", [0, True, 5], "non-negative ints"),
        ("layers", [0, "2", 5], "non-negative ints"),
        ("layers", (0, 2, 5), None),  # msgpack has no tuples: packed as the same list, valid
        ("layers", 3, "must be a list"),
        ("layers", list(range(wire.MAX_RUN_LAYERS + 1)), "1 to"),
        ("shape", [4, 4], r"3 layers x shape \[4, 4\]"),
        ("shape", [2**31, 2**31], "over the cap"),
        ("dtype", "bfloat16", r"3 layers x shape \[4, 5\] x 2 B"),
        ("page_kind", "kv", "unknown page kind"),
        ("nbytes", 241, "payload has"),
    ],
)
def test_bad_run_header_field(field: str, value: Any, match: str | None) -> None:
    header, payload = run_parts()
    h = header_of([header])
    h[field] = value
    repacked = repack(h, payload=payload)
    if match is None:
        assert decode_frame(repacked, payload).layers == (0, 2, 5)
        return
    with pytest.raises(FrameError, match=match):
        decode_frame(repacked, payload)


def test_run_checksum_covers_its_layers() -> None:
    header, payload = run_parts()
    h = header_of([header])
    h["layers"] = [1, 2, 5]  # still valid and consistent: only the checksum can tell
    with pytest.raises(FrameError, match=r"checksum mismatch on layers \[1, 2, 5\] 'ssm'"):
        decode_frame(repack(h, fix_checksum=False), payload)
    with pytest.raises(FrameError, match="truncated"):
        decode_frame(header, bytes(payload)[:-4])
    h = header_of([header])
    h["layer"] = 0  # a page frame's field in a run frame
    with pytest.raises(FrameError, match=r"unexpected fields \['layer'\]"):
        decode_frame(repack(h, payload=payload), payload)


def test_encode_run_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="ascending"):
        encode_run("r", [2, 1], "ssm", "x", torch.ones(2, 3))
    with pytest.raises(ValueError, match="ascending"):
        encode_run("r", [], "ssm", "x", torch.ones(0, 3))
    with pytest.raises(ValueError, match=r"needs a tensor \[2, ...\]"):
        encode_run("r", [1, 2], "ssm", "x", torch.ones(3, 3))
    with pytest.raises(ValueError, match="dtype"):
        encode_run("r", [1, 2], "ssm", "x", torch.ones(2, 3, dtype=torch.complex64))


def test_missing_and_extra_fields() -> None:
    header, payload = page_parts()
    h = header_of([header])
    del h["shape"]
    with pytest.raises(FrameError, match=r"missing fields \['shape'\]"):
        decode_frame(repack(h, payload=payload), payload)
    h = header_of([header])
    h["pickle"] = b"\x80\x04"
    with pytest.raises(FrameError, match=r"unexpected fields \['pickle'\]"):
        decode_frame(repack(h, payload=payload), payload)


def test_non_map_and_non_bytes_header() -> None:
    _, payload = page_parts()
    for obj in ([1, 2, 3], "PDSM", 7, None):
        with pytest.raises(FrameError, match="must be a msgpack map"):
            decode_frame(msgpack.packb(obj), payload)
    with pytest.raises(FrameError, match="bytes-like"):
        decode_frame("not bytes", payload)  # type: ignore[arg-type]
    with pytest.raises(FrameError, match="not valid msgpack"):
        decode_frame(msgpack.packb({1: 2}), payload)  # non-str map key
    with pytest.raises(FrameError, match="exceeds the cap"):
        decode_frame(b"\x00" * (wire.MAX_HEADER_BYTES + 1), payload)


def test_ext_types_refused() -> None:
    header, payload = page_parts()
    h = header_of([header])
    h["name"] = msgpack.ExtType(42, b"\x80\x04N.")  # e.g. a smuggled pickle
    with pytest.raises(FrameError, match="ext type 42"):
        decode_frame(msgpack.packb(h), payload)
    h["name"] = msgpack.Timestamp(1, 2)  # ext -1 bypasses ext_hook: caught by the type checks
    with pytest.raises(FrameError, match="must be str"):
        decode_frame(msgpack.packb(h, datetime=False), payload)


def body_frame(kind: str, body: Any, req_id: str = "req-1") -> list[Any]:
    payload = msgpack.packb(body, use_bin_type=True)
    h = {"magic": wire.MAGIC, "version": wire.VERSION, "kind": kind, "req_id": req_id, "nbytes": len(payload)}
    return [repack(h, payload=payload), payload]


def request_body(**over: Any) -> dict[str, Any]:
    req = make_pages().request
    body = {f: getattr(req, f) for f in wire._REQUEST_ORDER}
    body.update(over)
    return body


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ([1, 2], "must be a msgpack map"),
        (request_body(req_id="other"), "header names"),
        (request_body(prompt_token_ids=[1, -2]), "non-negative ints"),
        (request_body(output_token_ids=[1.0]), "non-negative ints"),
        (request_body(seed="1"), "must be int"),
        (request_body(prompt=3), "must be str"),
        (request_body(params=[]), "must be dict"),
        (request_body(params={"x": msgpack.Timestamp(1, 0)}), "plain msgpack values"),
        (request_body(evil=1), r"unexpected fields \['evil'\]"),
        ({k: v for k, v in request_body().items() if k != "seed"}, r"missing fields \['seed'\]"),
    ],
)
def test_bad_request_body(body: Any, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        decode_frame(*body_frame("request", body))


def test_request_body_checksum_and_deep_nesting() -> None:
    header, payload = encode_request(make_pages().request)
    bad = bytearray(payload)
    bad[-1] ^= 0x20
    with pytest.raises(FrameError, match="checksum mismatch"):
        decode_frame(header, bytes(bad))
    deep: Any = 1
    for _ in range(wire_fields.MAX_BODY_DEPTH + 2):
        deep = [deep]
    with pytest.raises(FrameError, match="nest deeper"):
        decode_frame(*body_frame("request", request_body(params={"x": deep})))


def test_bad_end_body() -> None:
    with pytest.raises(FrameError, match="end body"):
        decode_frame(*body_frame("end", {"num_frames": 2, "x": 1}))
    with pytest.raises(FrameError, match=">= 0"):
        decode_frame(*body_frame("end", {"num_frames": -1}))
    f = decode_frame(*encode_end("req-1", 5))
    assert f == Frame("end", "req-1", body={"num_frames": 5})


def test_abort_frame() -> None:
    f = decode_frame(*wire.encode_abort("req-1", "client went away"))
    assert f == Frame("abort", "req-1", body={"reason": "client went away"})
    with pytest.raises(FrameError, match="abort body"):
        decode_frame(*body_frame("abort", {"reason": "x", "extra": 1}))
    with pytest.raises(FrameError, match="'reason' must be str"):
        decode_frame(*body_frame("abort", {"reason": 7}))
    asm = PageAssembler("req-1")
    asm.add(decode_frame(*encode_request(make_pages().request)))
    with pytest.raises(FrameError, match="aborted by its sender: client went away"):
        asm.add(f)


def test_page_frame_with_body_fields_rejected() -> None:
    header, payload = encode_end("req-1", 3)
    h = header_of([header])
    h["layer"] = 0
    with pytest.raises(FrameError, match=r"unexpected fields \['layer'\]"):
        decode_frame(repack(h, payload=payload), payload)


# ----------------------------------------------------------------------------- assembly


def test_duplicate_frame_rejected() -> None:
    frames = pages_to_frames(make_pages())
    with pytest.raises(FrameError, match=r"duplicate frame: layers \[0, 2\] 'conv'"):
        frames_to_pages([*frames[:2], frames[1], *frames[2:]])
    with pytest.raises(FrameError, match="duplicate request frame"):
        frames_to_pages([frames[0], *frames])


def test_layer_of_a_run_repeated_by_another_frame_rejected() -> None:
    """A run frame must not repeat a layer any earlier page or run frame brought for its name."""
    pages = make_pages()
    frames = pages_to_frames(pages)
    conv2 = encode_page("req-1", 2, "ssm", "conv", pages.layers[2].tensors["conv"])
    with pytest.raises(FrameError, match=r"duplicate frame: layers \[2\] 'conv'"):
        frames_to_pages([*frames[:-1], conv2, frames[-1]])  # a page after the run
    with pytest.raises(FrameError, match=r"duplicate frame: layers \[2\] 'conv'"):
        frames_to_pages([frames[0], conv2, *frames[1:]])  # the run after a page
    overlapping = encode_run("req-1", [2, 5], "ssm", "conv", torch.stack([pages.layers[2].tensors["conv"]] * 2))
    with pytest.raises(FrameError, match=r"duplicate frame: layers \[2\] 'conv'"):
        frames_to_pages([*frames[:-1], overlapping, frames[-1]])
    attn = encode_run("req-1", [1, 2], "attention", "k2", torch.ones(2, 3))  # layer 2 is an SSM layer
    with pytest.raises(FrameError, match=r"layers \[2\] of 'req-1' sent as both ssm and attention"):
        frames_to_pages([*frames[:-1], attn, frames[-1]])


def test_missing_layer_rejected() -> None:
    frames = pages_to_frames(make_pages())
    kept = [f for f in frames if header_of(f).get("name") != "ssm"]  # the run of layers 0 and 2
    with pytest.raises(FrameError, match="sender sent 5 frames before end, 4 arrived"):
        frames_to_pages(kept)
    # the receiver's own model says which layers it needs: a sender that forgot one is caught
    pages = make_pages()
    del pages.layers[2]
    with pytest.raises(FrameError, match=r"missing layers \[2\]"):
        frames_to_pages(pages_to_frames(pages), expected_layers=[0, 1, 2])


def test_assembly_order_and_identity_errors() -> None:
    frames = pages_to_frames(make_pages())
    with pytest.raises(FrameError, match="before its request frame"):
        frames_to_pages([*frames[1:-1], encode_end("req-1", len(frames) - 2)])
    with pytest.raises(FrameError, match="after its end frame"):
        frames_to_pages([*frames, frames[1]])
    with pytest.raises(FrameError, match="no end frame"):
        frames_to_pages(frames[:-1])
    other = pages_to_frames(make_pages(req_id="req-2"))
    with pytest.raises(FrameError, match="given to the assembler of 'req-1'"):
        frames_to_pages([*frames[:-1], other[1], frames[-1]])
    with pytest.raises(FrameError, match="2 parts"):
        frames_to_pages([frames[0][:1]])
    h, p = encode_page("req-1", 0, "attention", "extra", torch.ones(2))
    with pytest.raises(FrameError, match="sent as both ssm and attention"):
        frames_to_pages([*frames[:-1], [h, p], frames[-1]])


# ----------------------------------------------------------------------------- properties

_FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)
_field_values = st.one_of(
    _plain,
    st.sampled_from(
        [wire.MAGIC, wire.VERSION, "page", "run", "request", "end", "ssm", "attention", "float32", "bfloat16"]
    ),
    st.lists(st.integers(-3, 2**40), max_size=9),
)
_maps = st.dictionaries(
    st.sampled_from(sorted(wire._FIELDS["page"] | wire._FIELDS["run"] | {"body", "x"})) | st.text(max_size=4),
    _field_values,
    max_size=12,
)


def _only_frame_errors(header: Any, payload: Any) -> None:
    try:
        decode_frame(header, payload)
    except FrameError:
        pass


@_FAST
@given(st.binary(max_size=256), st.one_of(st.none(), st.binary(max_size=256)))
def test_arbitrary_bytes_raise_only_frame_error(header: bytes, payload: bytes | None) -> None:
    _only_frame_errors(header, payload)


@_FAST
@given(_maps, st.binary(max_size=64), st.booleans())
def test_arbitrary_headers_raise_only_frame_error(h: dict[str, Any], payload: bytes, fix: bool) -> None:
    base = {"magic": wire.MAGIC, "version": wire.VERSION}
    h = {**base, **h}
    if fix and isinstance(h.get("nbytes"), int):
        h["nbytes"] = len(payload)
    try:
        header = repack(h, fix_checksum=fix, payload=payload)
    except Exception:  # our checksum helper on garbage identity fields: not the parser's concern
        header = msgpack.packb(h, use_bin_type=True)
    _only_frame_errors(header, payload)


@_FAST
@given(st.data())
def test_mutated_real_frames_raise_only_frame_error(data: st.DataObject) -> None:
    frames = pages_to_frames(make_pages())
    header, payload = (bytes(x) for x in data.draw(st.sampled_from(frames)))
    target = data.draw(st.sampled_from(["header", "payload"]))
    buf = bytearray(header if target == "header" else payload)
    for _ in range(data.draw(st.integers(1, 4))):
        if buf:
            buf[data.draw(st.integers(0, len(buf) - 1))] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(buf)))
    buf = buf[:cut] if data.draw(st.booleans()) else buf
    mutated = (bytes(buf), payload) if target == "header" else (header, bytes(buf))
    try:
        got = decode_frame(*mutated)
    except FrameError:
        return
    # NOTE: a mutation may re-encode the same values (msgpack uint16 -> int16 of one number):
    # whatever decodes must then be exactly the original frame, never a different one.
    want = decode_frame(header, payload)
    assert got._replace(tensor=None) == want._replace(tensor=None)
    assert (got.tensor is None) == (want.tensor is None)
    if got.tensor is not None and want.tensor is not None:
        assert same_bits(got.tensor, want.tensor)


_run_layers = st.one_of(
    st.lists(st.integers(-2, 70), max_size=12),
    st.lists(st.one_of(st.integers(0, 9), st.booleans(), st.floats(0, 9), st.text(max_size=2)), max_size=5),
    _plain,
)


@_FAST
@given(_run_layers, st.lists(st.integers(-1, 9), max_size=4) | _plain, st.sampled_from(sorted(wire.DTYPES)),
       st.binary(max_size=96), st.booleans())
def test_arbitrary_run_headers_raise_only_frame_error(
    layers: Any, shape: Any, dtype: str, payload: bytes, fix_nbytes: bool
) -> None:
    """Run frames whose header is otherwise well formed (checksum right): any layers list or shape
    gives a FrameError or a frame whose tensor is exactly the payload's bytes."""
    h = {"magic": wire.MAGIC, "version": wire.VERSION, "kind": "run", "req_id": "r", "layers": layers,
         "page_kind": "ssm", "name": "x", "dtype": dtype, "shape": shape, "nbytes": len(payload) if fix_nbytes else 40}
    try:
        header = repack(h, payload=payload)
    except Exception:  # our checksum helper on garbage identity fields: not the parser's concern
        header = msgpack.packb({**h, "checksum": 0}, use_bin_type=True)
    try:
        f = decode_frame(header, payload)
    except FrameError:
        return
    assert f.kind == "run" and f.layers is not None and f.tensor is not None
    assert list(f.layers) == sorted(set(f.layers)) and f.tensor.shape[0] == len(f.layers)
    assert f.tensor.numel() * f.tensor.element_size() == len(payload)


@_FAST
@given(st.data())
def test_mutated_run_frames_raise_only_frame_error(data: st.DataObject) -> None:
    """Bytes of a real run frame flipped, cut or spliced: FrameError, or exactly the original."""
    header, payload = (bytes(x) for x in run_parts(data.draw(st.sampled_from([(0, 1), (0, 2, 5), (7,)]))))
    parts = [bytearray(header), bytearray(payload)]
    for _ in range(data.draw(st.integers(1, 4))):
        buf = parts[data.draw(st.integers(0, 1))]
        if buf:
            buf[data.draw(st.integers(0, len(buf) - 1))] ^= data.draw(st.integers(1, 255))
    which = data.draw(st.integers(0, 1))
    if data.draw(st.booleans()):
        parts[which] = parts[which][: data.draw(st.integers(0, len(parts[which])))]
    try:
        got = decode_frame(bytes(parts[0]), bytes(parts[1]))
    except FrameError:
        return
    want = decode_frame(header, payload)
    assert got._replace(tensor=None) == want._replace(tensor=None)
    assert got.tensor is not None and want.tensor is not None and same_bits(got.tensor, want.tensor)


def test_hostile_buffers() -> None:
    header, payload = page_parts()
    with pytest.raises(FrameError, match="not valid msgpack"):
        decode_frame(b"\x91" * 10_000, payload)  # nesting far past msgpack's stack
    with pytest.raises(FrameError, match="not contiguous"):
        decode_frame(header, memoryview(bytes(payload) * 2)[::2])
    with pytest.raises(FrameError, match="bytes-like"):
        decode_frame(header, 12)  # type: ignore[arg-type]
