"""PinnedPool's bookkeeping (unpinned buffers on a CPU-only machine: the same code path)."""

from __future__ import annotations

import pytest
import torch

from pd_ssm.state_transfer.nccl_pinned import PinnedPool


def test_a_buffer_is_reused_once_given_back() -> None:
    pool = PinnedPool(keep=2, pin=torch.cuda.is_available())
    a = pool.take(100)
    assert a.dtype == torch.int64 and a.numel() >= 100
    b = pool.take(100)  # `a` is still held: another one
    assert b.data_ptr() != a.data_ptr() and pool.allocated == 2
    pool.give(a)
    assert pool.take(50).data_ptr() == a.data_ptr() and pool.allocated == 2
    big = pool.take(5000)  # too large for any free one
    assert big.numel() >= 5000 and pool.allocated == 3


def test_the_smallest_that_fits_and_at_most_keep_free() -> None:
    pool = PinnedPool(keep=2, pin=torch.cuda.is_available())
    small, mid, large = pool.take(10), pool.take(3000), pool.take(20000)
    for t in (large, small, mid):
        pool.give(t)
    assert len(pool) == 2  # the smallest went
    assert pool.take(2000).data_ptr() == mid.data_ptr()
    assert pool.take(1).data_ptr() == large.data_ptr()
    with pytest.raises(ValueError):
        PinnedPool(keep=0)
