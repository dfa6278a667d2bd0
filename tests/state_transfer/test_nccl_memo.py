"""The NCCL connector's memos of run headers: bounded, and a hit is exactly what computing gives --
a runs part that differs in one byte, or sits elsewhere in the message, is checked afresh."""

from __future__ import annotations

import msgpack
import pytest
import torch

from pd_ssm.state_transfer.nccl_memo import Memo
from pd_ssm.state_transfer.nccl_message import Layouts, plan
from pd_ssm.state_transfer.nccl_unpack import Headers, parse_tensors
from pd_ssm.state_transfer.wire import FrameError
from tests.state_transfer.test_nccl_message import make_pages


def test_memo_evicts_the_oldest_entry() -> None:
    memo: Memo[int] = Memo(2)
    memo.put("a", 1)
    memo.put("b", 2)
    memo.put("a", 3)  # a refresh does not evict
    memo.put("c", 4)
    assert len(memo) == 2 and memo.get("a") is None and memo.get("b") == 2 and memo.get("c") == 4
    assert (memo.hits, memo.misses) == (2, 1)
    with pytest.raises(ValueError):
        Memo(0)


def test_a_memoized_plan_is_the_plan() -> None:
    pages = [make_pages(f"r{i}", torch.float32, i) for i in range(3)]
    layouts: Layouts = Memo(8)
    first = plan(pages, layouts)
    again = plan(pages, layouts)  # every request's layout from the memo now
    fresh = plan(pages)
    assert layouts.hits == 3 and layouts.misses == 3
    for p in (first, again):
        assert p.packed == fresh.packed and p.headers == fresh.headers and p.sizes == fresh.sizes
        assert p.payload == fresh.payload and p.metas == fresh.metas
    # the sources are the pages' own tensors, never a memoized request's
    assert [len(s) for s in again.sources] == [len(s) for s in fresh.sources]
    mine, theirs = again.sources[1][0], fresh.sources[1][0]  # per-layer pages: one tensor per layer
    assert isinstance(mine, list) and isinstance(theirs, list) and all(a is b for a, b in zip(mine, theirs, strict=True))
    assert msgpack.unpackb(again.packed[2]) == fresh.metas[2]


def test_a_memoized_parse_rechecks_anything_that_differs() -> None:
    planned = plan([make_pages("a", torch.float32, 0), make_pages("b", torch.float32, 1)])
    start, end = planned.sizes[0], planned.payload
    raw = planned.packed[1]
    headers: Headers = Memo(8)
    want = parse_tensors(raw, start, end)
    assert parse_tensors(raw, start, end, headers) == want
    assert parse_tensors(bytes(raw), start, end, headers) == want and headers.hits == 1
    with pytest.raises(FrameError, match="offset"):  # the same bytes at another place in the message
        parse_tensors(raw, 0, end - start, headers)
    bad = bytearray(raw)
    bad[-1] ^= 0x01  # the last run's checksum, one bit
    for _ in range(2):  # a failure is not memoized: it fails every time
        with pytest.raises(FrameError, match="checksum mismatch"):
            parse_tensors(bytes(bad), start, end, headers)
    assert len(headers) == 1
