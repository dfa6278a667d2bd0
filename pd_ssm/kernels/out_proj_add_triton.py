"""Triton `out_proj_add_ref` for one decode row: out_proj's GEMV with the residual add in its epilogue.

Each program of the one-row GEMV (skinny_linear_triton.py's, same tile and prefetch) owns BLOCK_N
output columns. It finishes them as `add_rms_norm` would: scales them by the gated norm's deferred
row scale (RowRms: the squares the state update wrote), adds them to the residual and writes the
new residual; then, for the next norm, writes weight * residual and its columns' sum of squares
(one partial of the norm's statistics). No program waits for another: the norm's scale is applied
by the next in_proj (pending_norm.py), so the norm's launch, a one-program reduction between two
weight streams, is gone.

Arithmetic: out_proj's output is rounded to g's dtype (as the plain GEMV stores it), then the add
is the reference's: fp32 sum of residual.to(residual_dtype) and out * r, one rounding. The norm's
input is that residual rounded to the norm weight's dtype, the weight product rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._checks import FLOAT_DTYPES, check_dtype, check_last_dim_contiguous, check_shape
from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.launch import FastKernel
from pd_ssm.kernels.pdl import launch_options, pdl_gate, use_pdl
from pd_ssm.kernels.pending_norm import PendingNorm
from pd_ssm.kernels.rmsnorm import RowRms
from pd_ssm.kernels.skinny_linear_triton import LinearTile, fma_gemv_main, fma_gemv_pre, fma_tile, gemv_serves


@triton.jit
def _out_proj_add_kernel(
    # pointers
    g_ptr, w_ptr, sq_ptr, res_ptr, nw_ptr, res_out_ptr, x_out_ptr, ss_ptr,
    # dimensions (K is specialized on: a layer's K never changes)
    N, K: tl.constexpr, n_sq, width, eps,
    # strides (the last axes have stride 1)
    stride_wn,
    # meta-parameters
    SQ_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr, PRE_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output column
    n_ok = offs_n < N
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
    rdt = res_out_ptr.dtype.element_ty
    new = (res.to(rdt).to(tl.float32) + out * r).to(rdt)
    tl.store(res_out_ptr + offs_n, new, mask=n_ok)
    h = new.to(nw_ptr.dtype.element_ty).to(tl.float32)  # the norm rounds the residual to its dtype
    tl.store(x_out_ptr + offs_n, (nw.to(tl.float32) * h).to(x_out_ptr.dtype.element_ty), mask=n_ok)
    tl.store(ss_ptr + pid, tl.sum(tl.where(n_ok, h * h, 0.0), axis=0))


_OUT_PROJ_ADD = FastKernel(_out_proj_add_kernel)


def pending_norm_triton(g: Tensor, weight: Tensor) -> bool:
    """Whether a block boundary on out_proj's (g, weight) takes `out_proj_add_triton` and leaves the
    next norm pending: one row on the weight-streaming GEMV (bf16 / fp16 on CUDA,
    skinny_linear_triton.gemv_serves). Measured on an H200 (2.7B shape, the batch-1 layer chain in a
    CUDA graph, benchmarks/decode_chain_gpu.py): RESULTS.md session 18."""
    return gemv_serves(g, weight) and g.shape[0] == 1


def out_proj_add_triton(
    g: Tensor, weight: Tensor, x_rms: RowRms, residual: Tensor, norm_weight: Tensor, eps: float, *,
    residual_dtype: torch.dtype, tile: LinearTile | None = None,
) -> tuple[Tensor, PendingNorm]:
    """Triton `out_proj_add_ref` (pending_norm.py) for one row: g [1, d_inner] and weight [d, d_inner]
    of one dtype, norm_weight [d]; residual [1, d] any float dtype (`pending_norm_triton` says where
    it is the faster choice). Returns (residual [1, d] in residual_dtype,
    PendingNorm(x [1, d] in norm_weight's dtype, ss [1, ceil(d / BLOCK_N)] fp32, eps)). `tile`: the
    GEMV's (default skinny_linear_triton.fma_tile's), for sweeps."""
    k = "out_proj_add"
    if (g.dim() != 2 or g.shape[0] != 1 or weight.dim() != 2 or weight.shape[1] != g.shape[1] or g.dtype != weight.dtype
            or g.stride(1) != 1 or weight.stride(1) != 1):
        raise ValueError(f"{k}: one row g [1, K] and weight [N, K] of one dtype, stride 1 on K; got g "
                         f"{tuple(g.shape)} {g.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    N = weight.shape[0]
    check_shape(k, "residual", residual, "[1, d]", (1, N))
    check_last_dim_contiguous(k, "residual", residual)
    check_shape(k, "norm_weight", norm_weight, "[d]", (N,))
    check_dtype(k, "norm_weight", norm_weight, FLOAT_DTYPES)
    check_shape(k, "x_rms.sq", x_rms.sq, "[1, K]", (1, x_rms.sq.shape[-1]))
    check_last_dim_contiguous(k, "x_rms.sq", x_rms.sq)
    t = tile or fma_tile(N)
    grid = cdiv(N, t.block_n)
    new = torch.empty((1, N), dtype=residual_dtype, device=g.device)  # [1, d]
    x = torch.empty((1, N), dtype=norm_weight.dtype, device=g.device)  # [1, d]
    ss = torch.empty((1, grid), dtype=torch.float32, device=g.device)  # [1, K]
    pdl = use_pdl(g)
    n_sq = x_rms.sq.shape[1]
    with on_device(g):
        _OUT_PROJ_ADD[(grid,)](
            g, weight, x_rms.sq, residual, norm_weight.contiguous(), new, x, ss, N, weight.shape[1], n_sq,
            float(x_rms.width), float(x_rms.eps), weight.stride(0), SQ_BLOCK=pow2(n_sq), BLOCK_N=t.block_n,
            BLOCK_K=t.block_k, NUM_STAGES=t.num_stages, PDL=pdl, PRE_K=t.prefetch_k, num_warps=t.num_warps,
            **launch_options(pdl),
        )
    return new, PendingNorm(x, ss, eps)
