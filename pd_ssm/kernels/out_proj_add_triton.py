"""Triton `out_proj_add_ref` for a decode step: out_proj with the residual add in its epilogue.

One row. Each program of the one-row GEMV (skinny_linear_triton.py's, same tile and prefetch) owns BLOCK_N
output columns. It finishes them as `add_rms_norm` would: scales them by the gated norm's deferred
row scale (RowRms: the squares the state update wrote), adds them to the residual and writes the
new residual; then, for the next norm, writes weight * residual and its columns' sum of squares
(one partial of the norm's statistics). No program waits for another: the norm's scale is applied
by the next in_proj (pending_norm.py), so the norm's launch, a one-program reduction between two
weight streams, is gone.

More rows (up to PENDING_MAX_ROWS where `pending_norm_triton` takes it): the split-K GEMM of the
DOT path writes fp32 partial sums, and one reduce launch sums them and does the same epilogue per
(row, column block): it replaces cuBLAS's split-K GEMM, its reduce and the norm's launch.

Arithmetic: out_proj's output is rounded to g's dtype (as the plain GEMM stores it), then the add
is the reference's: fp32 sum of residual.to(residual_dtype) and out * r, one rounding. The norm's
input is that residual rounded to the norm weight's dtype, the weight product rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._checks import check_dtype, check_last_dim_contiguous, check_shape
from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.l2_prefetch import L2Rows, check_hint
from pd_ssm.kernels.l2_prefetch_triton import prefetch_args, prefetch_rows_l2
from pd_ssm.kernels.launch import FastKernel
from pd_ssm.kernels.pdl import launch_options, pdl_gate, use_pdl
from pd_ssm.kernels.pending_norm import PendingNorm
from pd_ssm.kernels.rmsnorm import RowRms
from pd_ssm.kernels.rmsnorm_triton import _row_scale
from pd_ssm.kernels.skinny_gemm_triton import launch_dot
from pd_ssm.kernels.skinny_linear_triton import (
    MAX_ROWS,
    LinearTile,
    fma_gemv_main,
    fma_gemv_pre,
    fma_tile,
    tile_cols,
)


@triton.jit
def _add_and_leave_pending(out, r, res, nw, res_out, x_out, ss_out, n_ok):
    """The epilogue both kernels share, on a block of columns: res_out = residual + out * r (fp32 sum,
    one rounding to the residual's dtype), then for the next norm x_out = weight * that residual
    (the residual rounded to the weight's dtype, the product rounded once) and *ss_out = the sum of
    its squares over the block."""
    rdt = res_out.dtype.element_ty
    new = (res.to(rdt).to(tl.float32) + out * r).to(rdt)
    tl.store(res_out, new, mask=n_ok)
    h = new.to(nw.dtype).to(tl.float32)  # the norm rounds the residual to its dtype
    tl.store(x_out, (nw.to(tl.float32) * h).to(x_out.dtype.element_ty), mask=n_ok)
    tl.store(ss_out, tl.sum(tl.where(n_ok, h * h, 0.0), axis=0))


@triton.jit
def _out_proj_add_kernel(
    # pointers
    g_ptr, w_ptr, sq_ptr, res_ptr, nw_ptr, res_out_ptr, x_out_ptr, ss_ptr,
    # dimensions (K is specialized on: a layer's K never changes)
    N, K: tl.constexpr, n_sq, width, eps,
    # strides (the last axes have stride 1)
    stride_wn,
    # the next kernel's L2 hint (l2_prefetch.py)
    pf_ptr, pf_rows, pf_stride, pf_share, pf_lines,
    # meta-parameters
    SQ_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr, PRE_K: tl.constexpr, COLS: tl.constexpr,
    PF_ROWS: tl.constexpr, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr,
):
    """A program owns COLS <= BLOCK_N output columns."""
    pid = tl.program_id(0)
    offs_n = pid * COLS + tl.arange(0, BLOCK_N)  # [BLOCK_N] output column
    n_ok = (offs_n < N) & (tl.arange(0, BLOCK_N) < COLS)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    # before the PDL gate: the residual (written three launches back, by the block boundary before
    # this one), the next norm's weight and the first weight columns
    res = tl.load(res_ptr + offs_n, mask=n_ok, other=0.0)
    nw = tl.load(nw_ptr + offs_n, mask=n_ok, other=0.0)
    w_pre = fma_gemv_pre(w_rows, n_ok, K, PRE_K)
    pdl_gate(PDL)
    offs_q = tl.arange(0, SQ_BLOCK)
    sq = tl.load(sq_ptr + offs_q, mask=offs_q < n_sq, other=0.0)  # issued now, summed after the stream
    y = fma_gemv_main(g_ptr, w_pre, w_rows, n_ok, K, BLOCK_N, BLOCK_K, NUM_STAGES, PRE_K)
    out = y.to(g_ptr.dtype.element_ty).to(tl.float32)  # out_proj's output as the GEMV stores it
    r = 1.0 / tl.sqrt_rn(tl.sum(sq, axis=0) / width + eps)
    _add_and_leave_pending(out, r, res, nw, res_out_ptr + offs_n, x_out_ptr + offs_n, ss_ptr + pid, n_ok)
    prefetch_rows_l2(pf_ptr, pf_rows, pf_stride, pf_share, pf_lines, pid, PF_ROWS, PF_LINES, PF_LINE)


@triton.jit
def _split_reduce_add_kernel(
    # pointers
    ws_ptr, sq_ptr, res_ptr, nw_ptr, res_out_ptr, x_out_ptr, ss_ptr,
    # dimensions
    M, N, n_sq, width, eps,
    # strides (the last axes have stride 1)
    stride_sq, stride_res, stride_ss,
    # meta-parameters
    SPLIT: tl.constexpr, SQ_BLOCK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """More than one row: out_proj's fp32 partial sums ws [SPLIT, M, N] (the split-K GEMM's) summed in
    a fixed order and rounded to the output dtype as the GEMM's own reduce would, then the one-row
    kernel's epilogue: one program per (column block, row)."""
    pid = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    n_ok = offs_n < N
    # before the PDL gate (pdl.py): all but the partials, which the GEMM launched just before writes;
    # the squares come from the state update before it, the residual from the boundary before that
    res = tl.load(res_ptr + m * stride_res + offs_n, mask=n_ok, other=0.0)
    nw = tl.load(nw_ptr + offs_n, mask=n_ok, other=0.0)
    r = _row_scale(sq_ptr, m, stride_sq, n_sq, width, eps, True, SQ_BLOCK)
    pdl_gate(PDL)
    y = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        y += tl.load(ws_ptr + (s * M + m) * N + offs_n, mask=n_ok, other=0.0)
    out = y.to(x_out_ptr.dtype.element_ty).to(tl.float32)  # out_proj's output as the GEMM stores it
    row = m * stride_res + offs_n
    _add_and_leave_pending(out, r, res, nw, res_out_ptr + row, x_out_ptr + row, ss_ptr + m * stride_ss + pid, n_ok)


_OUT_PROJ_ADD = FastKernel(_out_proj_add_kernel)
_SPLIT_REDUCE_ADD = FastKernel(_split_reduce_add_kernel)
# NOTE: more than one row: a split-K tile; 32 columns kept up with cuBLAS in the batch-32 decode
# chain (82.89 / 83.38 against 82.50 / 83.23 us a layer, benchmarks/wide_out_proj_gpu.py, H200,
# RESULTS.md session 18), 64 (the wgmma's M) stream out_proj alone at 32 rows in 9.5-10.0 against
# 10.6-11.0 us (benchmarks/few_row_gemm_gpu.py, session 20); the reduce's column block
WIDE_TILE = LinearTile(64, 128, 4, 4, split_k=4)
REDUCE_BLOCK = 512
PENDING_MAX_ROWS = 32  # measured up to here (RESULTS.md session 18); cuBLAS and the norm launch above


def pending_norm_triton(g: Tensor, weight: Tensor) -> bool:
    """Whether a block boundary on out_proj's (g, weight) takes `out_proj_add_triton` and leaves the
    next norm pending: bf16 / fp16 on CUDA, stride 1 on K, at most PENDING_MAX_ROWS rows. Measured on
    an H200 (2.7B shape; the batch-1 layer chain, benchmarks/decode_chain_gpu.py, and the engine's
    decode steps): RESULTS.md session 18."""
    return (g.is_cuda and g.dim() == 2 and 0 < g.shape[0] <= PENDING_MAX_ROWS and g.dtype in (torch.bfloat16,
            torch.float16) and weight.dtype == g.dtype and g.stride(1) == 1 and weight.stride(1) == 1)


def out_proj_add_triton(
    g: Tensor, weight: Tensor, x_rms: RowRms, residual: Tensor, norm_weight: Tensor, eps: float, *,
    residual_dtype: torch.dtype, tile: LinearTile | None = None, prefetch: L2Rows | None = None,
) -> tuple[Tensor, PendingNorm]:
    """Triton `out_proj_add_ref` (pending_norm.py): g [M, d_inner], weight [d, d_inner] and norm_weight
    [d] of one dtype; residual [M, d] any float dtype (`pending_norm_triton` says where it is the
    faster choice). Returns (residual [M, d] in residual_dtype, PendingNorm(x [M, d], ss [M, K] fp32,
    eps)). `tile`: the GEMV's at one row (default skinny_linear_triton.fma_tile's), the split-K
    GEMM's at more (default WIDE_TILE), for sweeps. `prefetch`: what the next kernel streams first (the
    next block's in_proj weight), asked of L2 once their outputs are stored by the one-row GEMV's
    programs, at more rows by the split-K GEMM's (l2_prefetch.py); it changes no value."""
    k = "out_proj_add"
    if (g.dim() != 2 or not 0 < g.shape[0] <= MAX_ROWS or weight.dim() != 2 or weight.shape[1] != g.shape[1]
            or g.dtype != weight.dtype or g.stride(1) != 1 or weight.stride(1) != 1):
        raise ValueError(f"{k}: g [M, K] (1..{MAX_ROWS} rows) and weight [N, K] of one dtype, stride 1 on K; got g "
                         f"{tuple(g.shape)} {g.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    M, N = g.shape[0], weight.shape[0]
    check_shape(k, "residual", residual, "[M, d]", (M, N))
    check_last_dim_contiguous(k, "residual", residual)
    check_shape(k, "norm_weight", norm_weight, "[d]", (N,))
    check_dtype(k, "norm_weight", norm_weight, (g.dtype,))
    check_shape(k, "x_rms.sq", x_rms.sq, "[M, K]", (M, x_rms.sq.shape[-1]))
    check_last_dim_contiguous(k, "x_rms.sq", x_rms.sq)
    if prefetch is not None:
        check_hint(k, prefetch)
    residual = residual.contiguous()
    new = torch.empty((M, N), dtype=residual_dtype, device=g.device)  # [M, d]
    x = torch.empty((M, N), dtype=norm_weight.dtype, device=g.device)  # [M, d]
    n_sq = x_rms.sq.shape[1]
    if M > 1:
        t = tile or WIDE_TILE
        # the split-K GEMM's fp32 partials, summed with the epilogue by one launch
        ws = torch.empty((max(1, t.split_k), M, N), dtype=torch.float32, device=g.device)  # [S, M, d]
        # the GEMM's programs ask for the hint, not the reduce's: RESULTS.md session 24
        launch_dot(g, weight, ws, t, prefetch=prefetch)
        grid_n = cdiv(N, REDUCE_BLOCK)
        ss = torch.empty((M, grid_n), dtype=torch.float32, device=g.device)  # [M, K]
        pdl = use_pdl(g)
        with on_device(g):
            _SPLIT_REDUCE_ADD[(grid_n, M)](
                ws, x_rms.sq, residual, norm_weight.contiguous(), new, x, ss, M, N, n_sq, float(x_rms.width),
                float(x_rms.eps), x_rms.sq.stride(0), N, ss.stride(0), SPLIT=ws.shape[0], SQ_BLOCK=pow2(n_sq),
                BLOCK=REDUCE_BLOCK, PDL=pdl, num_warps=4, **launch_options(pdl),
            )
        return new, PendingNorm(x, ss, eps)
    t = tile or fma_tile(N)
    cols = tile_cols(t)
    grid = cdiv(N, cols)
    ss = torch.empty((1, grid), dtype=torch.float32, device=g.device)  # [1, K]
    pf = prefetch_args(prefetch, grid)
    pdl = use_pdl(g)
    with on_device(g):
        _OUT_PROJ_ADD[(grid,)](
            g, weight, x_rms.sq, residual, norm_weight.contiguous(), new, x, ss, N, weight.shape[1], n_sq,
            float(x_rms.width), float(x_rms.eps), weight.stride(0), *pf.runtime, SQ_BLOCK=pow2(n_sq),
            BLOCK_N=t.block_n, BLOCK_K=t.block_k, NUM_STAGES=t.num_stages, PDL=pdl, PRE_K=t.prefetch_k, COLS=cols,
            num_warps=t.num_warps, **pf.meta, **launch_options(pdl),
        )
    return new, PendingNorm(x, ss, eps)
