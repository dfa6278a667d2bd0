"""Coalescer (nccl_coalesce.py): which held requests make one NCCL data message -- bookkeeping only."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pd_ssm.state_transfer.nccl_coalesce import Coalescer, Queued


def _queued(req_id: str, nbytes: int) -> Queued:
    pages: Any = SimpleNamespace(req_id=req_id)  # the coalescer reads only the id and the byte count
    return Queued(pages, 0.0, nbytes)


def _ids(messages: list[list[Queued]]) -> list[list[str]]:
    return [[q.pages.req_id for q in m] for m in messages]


def test_held_requests_go_once_they_reach_the_cap() -> None:
    c = Coalescer(cap=250, limit=1000)
    assert c.add(_queued("a", 86)) == [] and c.add(_queued("b", 86)) == []
    assert _ids(c.add(_queued("c", 86))) == [["a", "b", "c"]]  # 258 >= 250: no wait for a fourth
    assert len(c) == 0 and c.take() == []


def test_a_request_alone_past_the_cap_goes_alone() -> None:
    c = Coalescer(cap=100, limit=1000)
    assert _ids(c.add(_queued("big", 400))) == [["big"]]


def test_the_limit_sends_what_was_held_first() -> None:
    c = Coalescer(cap=300, limit=300)
    assert c.add(_queued("a", 120)) == [] and c.add(_queued("b", 120)) == []
    # 240 + 120 would pass the limit: a and b leave as one message first; c (120 < cap) stays held
    assert _ids(c.add(_queued("c", 120))) == [["a", "b"]]
    assert c.req_ids == ["c"]
    assert _ids(c.add(_queued("d", 500))) == [["c"], ["d"]]  # c first (limit), then d alone (cap)


def test_drop_and_take_keep_the_byte_count() -> None:
    c = Coalescer(cap=100)
    c.add(_queued("a", 40))
    c.add(_queued("b", 40))
    assert c.drop("a") and not c.drop("zz") and c.req_ids == ["b"]
    assert _ids(c.add(_queued("c", 60))) == [["b", "c"]]  # 40 + 60 == cap: the dropped bytes no longer count


@pytest.mark.parametrize(("cap", "limit"), [(0, 10), (10, 5), (-1, None)])
def test_bad_caps_are_refused(cap: int, limit: int | None) -> None:
    with pytest.raises(ValueError, match="cap"):
        Coalescer(cap, limit)
