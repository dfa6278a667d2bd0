"""A data message's p2p ops (nccl_control.spans), laid out one request at a time on the sender
(nccl_layout.Layout) and summed one op at a time on the receiver (nccl_checksum.StreamedSums, on
the CPU through Triton's interpreter): the same buffer and the same sums as laid out and summed
whole."""

from __future__ import annotations

import pytest
import torch

from pd_ssm.cache.pages import StatePages
from pd_ssm.state_transfer.nccl_batch import op_groups
from pd_ssm.state_transfer.nccl_checksum import BLOCK, PendingSums, StreamedSums, same_sums, trailer_bytes
from pd_ssm.state_transfer.nccl_control import Control, spans
from pd_ssm.state_transfer.nccl_layout import Layout, fill
from pd_ssm.state_transfer.nccl_message import plan
from tests.state_transfer.test_nccl_connector import make_pages


def test_ops_carry_their_requests_the_last_with_bytes_carrying_the_trailer() -> None:
    assert spans([3 * BLOCK]) == [(0, 3 * BLOCK + trailer_bytes(3 * BLOCK))]  # a lone request: one op, as before
    sizes, total = [2 * BLOCK, 0, BLOCK, 3 * BLOCK, 0], 6 * BLOCK
    end = total + trailer_bytes(total)
    assert spans(sizes) == [(0, 2 * BLOCK), (2 * BLOCK, 3 * BLOCK), (3 * BLOCK, end)]
    assert spans(sizes, [2, 2, 1]) == [(0, 2 * BLOCK), (2 * BLOCK, end)]  # the last op has no bytes
    assert spans(sizes, [5]) == [(0, end)]
    assert spans([0, 0]) == [] and spans([]) == []  # no bytes, no op (nor a trailer)
    assert Control.data(2, ["a", "b"], [BLOCK, BLOCK]).spans == spans([BLOCK, BLOCK])
    assert Control.data(2, ["a", "b"], [BLOCK, BLOCK], [2]).spans == [(0, 2 * BLOCK + trailer_bytes(2 * BLOCK))]


def test_small_requests_share_an_op_until_it_holds_op_bytes() -> None:
    mb = 1 << 20
    assert op_groups([86 * mb] * 3, 16 * mb) == [1, 1, 1]  # Mamba2-2.7B bf16: an op each
    assert op_groups([mb] * 5, 2 * mb) == [2, 2, 1]
    assert op_groups([mb, 0, 3 * mb, mb], 2 * mb) == [3, 1]
    assert op_groups([mb] * 3, 1) == [1, 1, 1] and op_groups([], 1) == []


def _pages() -> list[StatePages]:
    return [make_pages(f"r{i}", dtype, seed=70 + i) for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float32])]


@pytest.mark.parametrize("groups", [None, [2, 1], [1, 2], [3]])
def test_each_op_is_laid_out_when_handed_out_and_the_whole_is_the_one_pass_buffer(groups: list[int] | None) -> None:
    pages = _pages()
    planned = plan(pages)
    whole = fill(plan(pages), torch.device("cpu"))
    layout = Layout(planned, torch.device("cpu"), groups)
    layout.buf.fill_(0xA5)  # not zeros: a byte the layout forgot to write shows
    want = spans(planned.sizes, groups)
    assert len(want) == (len(pages) if groups is None else len(groups))
    got = []
    for (start, end), op in zip(want, layout.ops(), strict=True):
        # NOTE: the op's bytes are final when it is handed out (the CPU writes at once): its send may start
        assert op.data_ptr() == layout.buf[start:].data_ptr() and op.numel() == end - start
        assert torch.equal(op, whole[start:end])
        got.append((start, end))
    assert got == want and torch.equal(layout.buf, whole)


@pytest.mark.parametrize("flip", [None, 37, BLOCK + 3])
def test_sums_streamed_op_by_op_equal_the_sums_of_the_whole(flip: int | None) -> None:
    pages = _pages()
    planned = plan(pages)
    buf = fill(planned, torch.device("cpu"))
    payload = planned.payload
    if flip is not None:
        buf[planned.sizes[0] + flip] ^= 0x08  # in the second request's part: it alone differs
    streamed = StreamedSums(buf, payload)
    for start, end in spans(planned.sizes):
        streamed.add(start, min(end, payload))
    streamed.close()
    whole = PendingSums(buf[:payload], buf[payload:])
    assert (streamed.wait(), streamed.theirs()) == (whole.wait(), whole.theirs())
    ends = [sum(planned.sizes[: i + 1]) for i in range(len(pages))]
    verdicts = [same_sums(streamed.wait(), streamed.theirs(), end - n, n) for end, n in zip(ends, planned.sizes, strict=True)]
    assert verdicts == [True, flip is None, True]


def test_a_layout_refuses_groups_that_do_not_cover_its_requests() -> None:
    planned = plan(_pages())
    for groups in ([1, 1], [2, 2], [0, 3]):
        with pytest.raises(ValueError, match="do not cover"):
            Layout(planned, torch.device("cpu"), groups)


def test_streamed_sums_refuse_a_buffer_without_room_for_the_trailer() -> None:
    with pytest.raises(ValueError, match="trailer"):
        StreamedSums(torch.zeros(2 * BLOCK, dtype=torch.uint8), 2 * BLOCK)
    empty = StreamedSums(torch.zeros(0, dtype=torch.uint8), 0)
    empty.close()
    assert empty.ready() and empty.wait() == b"" and empty.theirs() == b""


def test_an_ops_sums_are_queued_after_its_send_the_last_ops_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline: op i is handed out (its send posted) before its sums are queued, so they
    overlap its transfer; the last op carries the trailer, so its sums come first."""
    from pd_ssm.state_transfer import nccl_layout

    events: list[str] = []
    write = nccl_layout.write_sums

    def spy(part: torch.Tensor, trailer: torch.Tensor) -> None:
        events.append(f"sums {part.numel()}")
        write(part, trailer)

    monkeypatch.setattr(nccl_layout, "write_sums", spy)
    planned = plan(_pages())
    for op in Layout(planned, torch.device("cpu")).ops():
        events.append(f"send {op.numel()}")
    a, b, c = planned.sizes
    last = c + trailer_bytes(planned.payload)
    assert events == [f"send {a}", f"sums {a}", f"send {b}", f"sums {b}", f"sums {c}", f"send {last}"]
