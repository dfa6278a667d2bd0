"""Triton `in_proj_conv_ref` for a one-row decode step: in_proj's GEMV with the conv update folded in.

At batch 1 a Mamba2 layer's decode step is a chain of short launches (norm, in_proj, conv, state
update, out_proj), each paying its launch and ramp (RESULTS.md). The conv is channel-local: the
output of xBC channel c needs in_proj's column c of this token and the slot's last width-1 inputs
of channel c. So the GEMV program that computes columns [n, n + BLOCK_N) of in_proj finishes the
conv of those that are xBC channels: its launch is gone. The slot's state columns and the conv
weights are loaded before the GEMV's PDL gate (pdl.py): this layer's previous step wrote them.

The arithmetic is the conv update kernel's (conv1d_triton_update.py) on in_proj's output as the
GEMV rounds it: same casts, same order (history taps, then the new input, then the bias, then
SiLU), so proj and xbc equal the two-launch path's to the bit. More than one row, or no
CUDA bf16/fp16: `in_proj_conv_triton` runs the two kernels it fuses, one after the other.

Its input may be the previous block's norm left pending (pending_norm.py): x is then weight *
residual, and the GEMV's fp32 sums are multiplied by the norm's scale, from the partial squares
the previous out_proj wrote, before the bias and the rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.conv1d import _check_conv_args
from pd_ssm.kernels.conv1d_triton_update import causal_conv1d_update_triton
from pd_ssm.kernels.conv1d_triton_varlen import _silu_in
from pd_ssm.kernels.launch import FastKernel
from pd_ssm.kernels.pdl import launch_options, pdl_gate, use_pdl
from pd_ssm.kernels.pending_norm import PendingNorm, check_pending_norm, linear_pending_ref
from pd_ssm.kernels.skinny_linear_triton import (
    FMA_MAX_ROWS,
    LinearTile,
    fma_gemv_main,
    fma_gemv_pre,
    fma_tile,
    gemv_serves,
    linear_triton,
    skinny_linear_triton,
)


@triton.jit
def _in_proj_conv_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, y_ptr, state_ptr, slot_ptr, cw_ptr, cb_ptr, xbc_ptr, ss_ptr,
    # dimensions (K is specialized on: a layer's K never changes)
    N, K: tl.constexpr, conv_start, conv_dim, n_ss, eps,
    # strides (the last axes have stride 1; the pool is contiguous: [slot, d, j])
    stride_wn, stride_cw_d, stride_cw_k,
    # meta-parameters
    HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, WIDTH: tl.constexpr, FAST_EXP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
    PRE_K: tl.constexpr, PENDING: tl.constexpr, SS_BLOCK: tl.constexpr,
):
    """PENDING: x is a PendingNorm's (ss_ptr its n_ss partial squares): the GEMV's sums are multiplied
    by the norm's scale (pending_norm.py)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] in_proj column
    n_ok = offs_n < N
    c = offs_n - conv_start  # [BLOCK_N] its conv channel (an xBC column) where 0 <= c < conv_dim
    c_ok = n_ok & (c >= 0) & (c < conv_dim)
    cc = tl.where(c_ok, c, 0)
    act = y_ptr.dtype.element_ty
    # before the GEMV's PDL gate: the slot, the conv weights and the history taps
    slot = tl.load(slot_ptr)
    live = slot >= 0  # a negative slot is CUDA-graph padding: touch no state, output zeros
    st_ok = c_ok & live
    row = state_ptr + tl.maximum(slot, 0).to(tl.int64) * conv_dim * (WIDTH - 1) + cc * (WIDTH - 1)  # [BLOCK_N]
    w_conv = cw_ptr + cc * stride_cw_d  # [BLOCK_N]
    w_last = tl.load(w_conv + (WIDTH - 1) * stride_cw_k, mask=c_ok, other=0.0)
    conv = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(WIDTH - 1):
        hk = tl.load(row + k, mask=st_ok, other=0.0).to(act)
        wk = tl.load(w_conv + k * stride_cw_k, mask=c_ok, other=0.0)
        conv += hk.to(tl.float32) * wk.to(tl.float32)
    if HAS_CONV_BIAS:
        conv_b = tl.load(cb_ptr + cc, mask=c_ok, other=0.0).to(tl.float32)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    w_pre = fma_gemv_pre(w_rows, n_ok, K, PRE_K)
    pdl_gate(PDL)
    if PENDING:
        offs_s = tl.arange(0, SS_BLOCK)
        ss = tl.load(ss_ptr + offs_s, mask=offs_s < n_ss, other=0.0)  # issued now, summed after the stream
    y = fma_gemv_main(x_ptr, w_pre, w_rows, n_ok, K, BLOCK_N, BLOCK_K, NUM_STAGES, PRE_K)
    if PENDING:
        y *= 1.0 / tl.sqrt_rn(tl.sum(ss, axis=0) / K + eps)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    xv = y.to(act)  # in_proj's output as it is stored: the conv's new input
    tl.store(y_ptr + offs_n, xv, mask=n_ok)

    conv += xv.to(tl.float32) * w_last.to(tl.float32)
    if HAS_CONV_BIAS:
        conv += conv_b
    out = _silu_in(conv.to(act), act, FAST_EXP)
    tl.store(xbc_ptr + cc, tl.where(live, out, 0.0).to(act), mask=c_ok)
    # shift left (column j <- column j + 1, re-read from L1; the newest <- xv); each barrier orders
    # every read of a column, whichever thread holds it, before that column is written
    for j in tl.static_range(WIDTH - 2):
        nxt = tl.load(row + (j + 1), mask=st_ok, other=0.0).to(act)
        tl.debug_barrier()
        tl.store(row + j, nxt.to(state_ptr.dtype.element_ty), mask=st_ok)
    tl.debug_barrier()
    tl.store(row + (WIDTH - 2), xv.to(state_ptr.dtype.element_ty), mask=st_ok)


def fusable(hidden: Tensor | PendingNorm, weight: Tensor) -> bool:
    """Whether the one-launch kernel serves this call: one row where the GEMV serves in_proj at all
    (skinny_linear_triton.gemv_serves)."""
    x = hidden.x if isinstance(hidden, PendingNorm) else hidden
    return gemv_serves(x, weight) and x.shape[0] == 1


_IN_PROJ_CONV = FastKernel(_in_proj_conv_kernel)


def in_proj_conv_triton(
    hidden: Tensor | PendingNorm,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    *,
    state_indices: Tensor,
    conv_start: int,
    fused: bool | None = None,
    tile: LinearTile | None = None,
) -> tuple[Tensor, Tensor]:
    """Triton `in_proj_conv_ref` (shapes there). `fused`: None picks the one-launch kernel where it
    serves (`fusable`), True forces it (tests, in Triton's interpreter too), False the two launches.
    `tile`, for sweeps: the one-launch GEMV's (default skinny_linear_triton.fma_tile's), or the DOT
    path's for a pending norm of more rows (default skinny_linear_triton.DOT_TILE)."""
    pending = hidden if isinstance(hidden, PendingNorm) else None
    if pending is not None:
        check_pending_norm("in_proj_conv", pending)
    x = hidden.x if isinstance(hidden, PendingNorm) else hidden
    B, K = x.shape
    N, conv_dim = weight.shape[0], conv_weight.shape[0]
    if weight.shape[1] != K or not 0 <= conv_start <= N - conv_dim:
        raise ValueError(f"in_proj_conv: hidden [B, K] {tuple(x.shape)}, weight [N, K] {tuple(weight.shape)} "
                         f"and xBC columns [{conv_start}, {conv_start + conv_dim}) do not fit")
    use = fusable(hidden, weight) if fused is None else fused
    if not use:
        if pending is None:
            proj = linear_triton(x, weight, bias)
        elif B > FMA_MAX_ROWS:
            proj = skinny_linear_triton(pending, weight, bias, tile=tile)  # the DOT path applies the scale
        else:
            proj = linear_pending_ref(pending, weight, bias)
        return proj, causal_conv1d_update_triton(proj[:, conv_start:conv_start + conv_dim], conv_state, conv_weight,
                                                 conv_bias, state_indices=state_indices)
    if B != 1 or x.stride(1) != 1 or weight.stride(1) != 1 or weight.dtype != x.dtype:
        raise ValueError("in_proj_conv: the one-launch kernel takes one row, x and weight of one dtype, stride 1 on K")
    proj = torch.empty((1, N), dtype=x.dtype, device=x.device)  # [1, N]
    _check_conv_args("in_proj_conv", proj[:, conv_start:conv_start + conv_dim], conv_weight, conv_bias, conv_state,
                     state_indices, 1, "silu")
    xbc = torch.empty((1, conv_dim), dtype=x.dtype, device=x.device)  # [1, conv_dim]
    t = tile or fma_tile(N)
    pdl = use_pdl(x)
    n_ss = 0 if pending is None else pending.ss.shape[1]
    with on_device(x):
        _IN_PROJ_CONV[(cdiv(N, t.block_n),)](
            x, weight, bias, proj, conv_state, state_indices.contiguous(), conv_weight, conv_bias, xbc,
            None if pending is None else pending.ss.contiguous(),
            N, K, conv_start, conv_dim, n_ss, 0.0 if pending is None else float(pending.eps),
            weight.stride(0), conv_weight.stride(0), conv_weight.stride(1),
            HAS_BIAS=bias is not None, HAS_CONV_BIAS=conv_bias is not None, WIDTH=conv_weight.shape[1],
            FAST_EXP=x.is_cuda, BLOCK_N=t.block_n, BLOCK_K=t.block_k, NUM_STAGES=t.num_stages, PDL=pdl,
            PRE_K=t.prefetch_k, PENDING=pending is not None, SS_BLOCK=pow2(n_ss), num_warps=t.num_warps,
            **launch_options(pdl),
        )
    return proj, xbc
