"""The L2 prefetch hint's bookkeeping (kernels/l2_prefetch.py, l2_prefetch_triton.py); what the hint
does to a kernel's outputs (nothing) is tested with its kernel (test_pending_norm.py,
test_in_proj_conv.py)."""

from __future__ import annotations

import pytest
import torch

from pd_ssm.kernels.l2_prefetch import L2Rows, check_hint
from pd_ssm.kernels.l2_prefetch_triton import prefetch_args

CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="the prefetch is asked for only on a CUDA device")
def test_each_program_asks_for_the_heads_of_its_share_of_rows() -> None:
    w = torch.randn(10576, 2560, device="cuda").to(torch.bfloat16)  # in_proj, 2.7B shape
    # out_proj's 640 one-row programs: 17 rows each, the first 512 bytes (4 lines of 64 elements) of each
    a = prefetch_args(L2Rows(w, 512), programs=640)
    assert a.runtime[0] is w and a.runtime[1:] == (10576, 2560, 17, 4)
    assert a.meta == {"PF_ROWS": 32, "PF_LINES": 4, "PF_LINE": 64}
    # a head longer than the row stops at its end: a 92-byte row is one line; 300 bytes of fp32, 3
    short = prefetch_args(L2Rows(w[:, :46], 8192), programs=640)
    assert short.runtime[2:] == (2560, 17, 1) and short.meta["PF_LINES"] == 1
    f = torch.randn(7, 75, device="cuda")
    assert prefetch_args(L2Rows(f, 300), programs=2).runtime[1:] == (7, 75, 4, 3)


def test_no_prefetch_asked_off_the_gpu() -> None:
    """Triton's interpreter runs no inline assembly: a CPU launch asks for nothing."""
    args = prefetch_args(L2Rows(torch.randn(40, 64), 512), programs=8)
    assert args.meta["PF_LINES"] == 0 and args.runtime[0] is None
    assert prefetch_args(None, programs=8).meta["PF_LINES"] == 0


def test_bad_hints_refused() -> None:
    w = torch.randn(40, 64)
    with pytest.raises(ValueError, match="stride 1"):
        check_hint("k", L2Rows(w.t(), 128))
    with pytest.raises(ValueError, match="2-D"):
        check_hint("k", L2Rows(w.flatten(), 128))
    with pytest.raises(ValueError, match="positive"):
        check_hint("k", L2Rows(w, 0))
