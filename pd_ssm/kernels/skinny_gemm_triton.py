"""The DOT path of skinny_linear_triton.py: y = x W^T (+ bias) for a few rows on the tensor cores.

Each program computes a tile of y, BLOCK_N columns by BLOCK_M rows, columns first (W's slice is
the dot's first operand: `dot_cols`), with tl.dot over [BLOCK_K] slices of K and fp32
accumulation; with a split of K, programs along the third grid axis each sum one slice into an
fp32 workspace [split, M, N] and a second launch adds the slices up in a fixed order
(deterministic, unlike atomics). The pending norm (pending_norm.py) uses both forms: in_proj
unsplit with the norm's row scale in its epilogue (up to 32 rows with the conv there too:
in_proj_conv_triton.py, which shares `dot_cols` and the scale), out_proj split with its own reduce
(out_proj_add_triton.py). The GEMM launches under PDL (pdl.py), as that reduce does: launched
without it, at 32 rows they left 45 and 22 us of idle GPU a decode step (126 and 63 launches;
benchmarks/graph_timeline_gpu.py, RESULTS.md session 19).

Numerics: fp32 accumulation, one rounding to the output dtype, bias added in fp32 before it; fp32
inputs take IEEE fp32 dots (never tf32). Reference: skinny_linear_triton.skinny_linear_ref.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.l2_prefetch import L2Rows
from pd_ssm.kernels.l2_prefetch_triton import prefetch_args, prefetch_rows_l2
from pd_ssm.kernels.launch import FastKernel
from pd_ssm.kernels.pdl import launch_options, pdl_gate, use_pdl

if TYPE_CHECKING:
    from pd_ssm.kernels.pending_norm import PendingNorm
    from pd_ssm.kernels.skinny_linear_triton import LinearTile


@triton.jit
def dot_cols(
    x_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, stride_xm, stride_wn, k_first, K: tl.constexpr,
    K_SPAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, K_MASK: tl.constexpr, INTERPRETED: tl.constexpr, IEEE: tl.constexpr,
):
    """acc [BLOCK_N, BLOCK_M] fp32 = W[offs_n, k] . x[offs_m, k] over k in [k_first, k_first + K_SPAN)
    (and < K where K_MASK), in BLOCK_K slices through a NUM_STAGES software pipeline: y's tile
    transposed, columns first."""
    # NOTE: W's slice is the dot's first operand, so that from 64 columns it is the wgmma's M on sm_90
    # (the rows, 16-64, its N), where a [rows, columns] tile takes mma v2 below 64 rows. out_proj
    # (split 4) at 32 rows streamed at 2.62-2.79 TB/s on wgmma against 2.38-2.47 for 32 columns on
    # mma v2 (H200, benchmarks/few_row_gemm_gpu.py, RESULTS.md session 20)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(0, K_SPAN, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k_first + k0 + tl.arange(0, BLOCK_K)
        if K_MASK:
            k_ok = offs_k < K
            w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            xt = tl.load(x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + offs_k[:, None],
                         mask=k_ok[:, None] & m_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_M] (x^T)
        else:
            w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None],
                        other=0.0)  # [BLOCK_N, BLOCK_K]
            xt = tl.load(x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + offs_k[:, None], mask=m_ok[None, :],
                         other=0.0)  # [BLOCK_K, BLOCK_M] (x^T)
        if INTERPRETED or IEEE:  # the interpreter's bf16 dot multiplies raw bits: exact fp32 products
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    return acc


@triton.jit
def row_squares(ss_ptr, offs_m, m_ok, stride_ss, n_ss, SS_BLOCK: tl.constexpr):
    """A pending norm's partial squares of the rows offs_m, [BLOCK_M, SS_BLOCK] (0 past n_ss): loaded
    before a GEMM's stream, summed after it (`pending_row_scale`), so their latency hides in it."""
    offs_s = tl.arange(0, SS_BLOCK)
    return tl.load(ss_ptr + offs_m.to(tl.int64)[:, None] * stride_ss + offs_s[None, :],
                   mask=m_ok[:, None] & (offs_s < n_ss)[None, :], other=0.0)


@triton.jit
def pending_row_scale(ss, K: tl.constexpr, eps):
    """[1, BLOCK_M]: each row's norm scale rsqrt(sum of its squares / K + eps) (pending_norm.py), against
    the columns-first tile."""
    return (1.0 / tl.sqrt_rn(tl.sum(ss, axis=1) / K + eps))[None, :]


@triton.jit
def _skinny_dot_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, y_ptr, ss_ptr,
    # dimensions (K is specialized on: a layer's K never changes, and the loop bound is static)
    M, N, K: tl.constexpr, n_ss, eps,
    # strides (the last axes have stride 1)
    stride_xm, stride_wn, stride_ym, stride_ss,
    # the next kernel's L2 hint (l2_prefetch.py)
    pf_ptr, pf_rows, pf_stride, pf_share, pf_lines,
    # meta-parameters
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, K_MASK: tl.constexpr,
    INTERPRETED: tl.constexpr, IEEE: tl.constexpr, PENDING: tl.constexpr, SS_BLOCK: tl.constexpr,
    PDL: tl.constexpr, PF_ROWS: tl.constexpr, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr,
):
    """SPLIT == 1: y = x W^T (+ bias) rounded once; else y_ptr is an fp32 [SPLIT, M, N] workspace of
    partial sums over K_PER_SPLIT-long slices of K (bias and rounding left to the reduce kernel).
    PENDING (SPLIT == 1): x is a pending norm's (pending_norm.py), ss_ptr [M, n_ss] its partial
    squares: each row's sums are multiplied by the norm's scale before the bias. The PDL gate
    (pdl.py) comes first: x and the squares may be the launch before's output."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_first = pid_s * K_PER_SPLIT
    pdl_gate(PDL)
    if PENDING:
        ss = row_squares(ss_ptr, offs_m, m_ok, stride_ss, n_ss, SS_BLOCK)
    acc = dot_cols(x_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, stride_xm, stride_wn, k_first, K, K_PER_SPLIT,
                   BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, K_MASK, INTERPRETED, IEEE)  # [BLOCK_N, BLOCK_M]
    out_ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT == 1:
        if PENDING:
            acc *= pending_row_scale(ss, K, eps)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=out_ok)
    else:
        part = y_ptr + (pid_s * M + offs_m.to(tl.int64))[None, :] * N + offs_n[:, None]
        tl.store(part, acc, mask=out_ok)
    flat = pid_n + tl.num_programs(0) * (pid_m + tl.num_programs(1) * pid_s)
    prefetch_rows_l2(pf_ptr, pf_rows, pf_stride, pf_share, pf_lines, flat, PF_ROWS, PF_LINES, PF_LINE)


@triton.jit
def _split_reduce_kernel(
    # pointers
    ws_ptr, b_ptr, y_ptr,
    # dimensions
    M, N,
    # strides
    stride_ym,
    # meta-parameters
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):
    """y[m, n] = sum over s of ws[s, m, n] (+ bias[n]) in a fixed order: deterministic, unlike atomics."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] flat (m, n)
    ok = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=ok, other=0.0)
    m = offs // N
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=ok)


_SKINNY_DOT = FastKernel(_skinny_dot_kernel)
_SPLIT_REDUCE = FastKernel(_split_reduce_kernel)


def check_dot_tile(kernel: str, t: LinearTile) -> None:
    """Refuse a tile knob the DOT path has not: prefetch_k is the one-row GEMV's (loaded before the PDL
    gate, it lost 0.4-3.1 us a layer in the DOT tile: RESULTS.md session 20)."""
    if t.prefetch_k:
        raise ValueError(f"{kernel}: prefetch_k is the one-row GEMV's; the DOT tile takes none, got {t.prefetch_k}")
    if t.cols:  # NOTE: 27 of 32 columns in in_proj's DOT tile lost at 8 and 32 rows (RESULTS.md session 22)
        raise ValueError(f"{kernel}: cols is the one-row kernels'; the DOT tile takes none, got {t.cols}")


def launch_dot(x: Tensor, weight: Tensor, out: Tensor, t: LinearTile, *, bias: Tensor | None = None,
               pending: PendingNorm | None = None, prefetch: L2Rows | None = None) -> None:
    """The DOT path's GEMM (arguments checked by the caller): out = x W^T (+ bias) [M, N] in x's dtype
    where t.split_k <= 1, else the fp32 partial sums [split, M, N] for a reduce launch to add up.
    `prefetch`: what a later kernel streams first, asked of L2 by every program once its tile is
    stored (l2_prefetch.py); it changes no value."""
    check_dot_tile("skinny_linear", t)
    M, K = x.shape
    N = weight.shape[0]
    block_m = min(64, max(16, pow2(M)))
    split = max(1, t.split_k)
    k_per_split = cdiv(cdiv(K, split), t.block_k) * t.block_k
    ss = None if pending is None else pending.ss.contiguous()
    n_ss = 0 if ss is None else ss.shape[1]
    pdl = use_pdl(x)
    grid = (cdiv(N, t.block_n), cdiv(M, block_m), split)
    pf = prefetch_args(prefetch, grid[0] * grid[1] * grid[2])
    with on_device(x):
        _SKINNY_DOT[grid](
            x, weight, bias, out, ss, M, N, K, n_ss, 0.0 if pending is None else float(pending.eps),
            x.stride(0), weight.stride(0), out.stride(-2), 0 if ss is None else ss.stride(0), *pf.runtime,
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
            K_PER_SPLIT=k_per_split, SPLIT=split, NUM_STAGES=t.num_stages, K_MASK=k_per_split * split != K,
            INTERPRETED=not x.is_cuda,
            IEEE=x.dtype == torch.float32, PENDING=pending is not None, SS_BLOCK=pow2(n_ss), PDL=pdl,
            num_warps=t.num_warps, **pf.meta, **launch_options(pdl),
        )


def launch_split_reduce(ws: Tensor, bias: Tensor | None, y: Tensor) -> None:
    """y [M, N] = ws [split, M, N] summed over the split (+ bias), rounded once to y's dtype."""
    split, M, N = ws.shape
    block = 1024
    _SPLIT_REDUCE[(cdiv(M * N, block),)](
        ws, bias, y, M, N, y.stride(0), HAS_BIAS=bias is not None, SPLIT=split, BLOCK=block, num_warps=4,
    )
