"""Triton side of l2_prefetch.py: the prefetches a kernel's programs issue after their last store."""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.l2_prefetch import LINE_BYTES, L2Rows


class PrefetchArgs(NamedTuple):
    """`prefetch_rows_l2`'s arguments for a kernel that takes them: `runtime` positionally (pf_ptr,
    pf_rows, pf_stride, pf_share, pf_lines), `meta` as constexpr keywords."""

    runtime: tuple[Tensor | int | None, ...]
    meta: dict[str, int]


def prefetch_args(hint: L2Rows | None, programs: int) -> PrefetchArgs:
    """For a grid of `programs`: each program asks for the heads of an even share of the rows. None,
    or CPU tensors (Triton's interpreter runs no inline assembly): PF_LINES = 0, nothing is asked."""
    t = None if hint is None else hint.t
    if t is None or not t.is_cuda:
        return PrefetchArgs((None, 0, 0, 0, 0), dict(PF_ROWS=1, PF_LINES=0, PF_LINE=1))
    assert hint is not None
    rows, cols = t.shape
    line = LINE_BYTES // t.element_size()  # elements a line
    lines = cdiv(min(hint.head_bytes, cols * t.element_size()), LINE_BYTES)  # never past the row's end
    share = cdiv(rows, programs)
    return PrefetchArgs((t, rows, t.stride(0), share, lines),
                        dict(PF_ROWS=pow2(share), PF_LINES=pow2(lines), PF_LINE=line))


@triton.jit
def prefetch_rows_l2(pf_ptr, pf_rows, pf_stride, pf_share, pf_lines, pid, PF_ROWS: tl.constexpr,
                     PF_LINES: tl.constexpr, PF_LINE: tl.constexpr):
    """Program `pid` asks L2 for the first pf_lines lines (PF_LINE elements each) of rows
    [pid * pf_share, (pid + 1) * pf_share) of pf_ptr [pf_rows, *] (row stride pf_stride elements).
    Call it after the program's last store."""
    if PF_LINES > 0:
        i = tl.arange(0, PF_ROWS)
        r = pid * pf_share + i  # [PF_ROWS] row
        ok = (i < pf_share) & (r < pf_rows)
        j = tl.arange(0, PF_LINES)  # [PF_LINES] line of the row
        ptrs = pf_ptr + r.to(tl.int64)[:, None] * pf_stride + (j * PF_LINE)[None, :]  # [PF_ROWS, PF_LINES]
        ask = (ok[:, None] & (j < pf_lines)[None, :]).to(tl.int32)
        # NOTE: not pure, so it is kept although nothing reads its (dummy) result
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [ptrs, ask], dtype=tl.int32, is_pure=False, pack=1,
        )
