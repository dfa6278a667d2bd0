"""Triton `in_proj_conv_ref` for a decode step: in_proj with the conv update folded in.

At batch 1 a Mamba2 layer's decode step is a chain of short launches (norm, in_proj, conv, state
update, out_proj), each paying its launch and ramp (RESULTS.md). The conv is channel-local: the
output of xBC channel c needs in_proj's column c of this token and the slot's last width-1 inputs
of channel c. So the GEMV program that computes columns [n, n + BLOCK_N) of in_proj finishes the
conv of those that are xBC channels: its launch is gone. The slot's state columns and the conv
weights are loaded before the GEMV's PDL gate (pdl.py): this layer's previous step wrote them.

The arithmetic is the conv update kernel's (conv1d_triton_update.py) on in_proj's output as the
GEMV rounds it: same casts, same order (history taps, then the new input, then the bias, then
SiLU), so proj and xbc equal the two-launch path's to the bit.

A pending norm (below) of 2..DOT_CONV_MAX_ROWS rows takes the DOT path's tile (skinny_gemm_triton.py)
with the same conv in its epilogue, on that tile (channels first: see the kernel's note).
Elsewhere (more rows, no pending norm, no CUDA bf16/fp16) `in_proj_conv_triton` runs the two
kernels it fuses, one after the other.

Its input may be the previous block's norm left pending (pending_norm.py): x is then weight *
residual, and the GEMV's fp32 sums are multiplied by the norm's scale, from the partial squares
the previous out_proj wrote, before the bias and the rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._device import num_sms, on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.conv1d import _check_conv_args
from pd_ssm.kernels.conv1d_triton_update import causal_conv1d_update_triton
from pd_ssm.kernels.conv1d_triton_varlen import _silu_in
from pd_ssm.kernels.l2_prefetch import L2Rows, check_hint
from pd_ssm.kernels.l2_prefetch_triton import prefetch_args, prefetch_rows_l2
from pd_ssm.kernels.launch import FastKernel
from pd_ssm.kernels.pdl import launch_options, pdl_gate, use_pdl
from pd_ssm.kernels.pending_norm import PendingNorm, check_pending_norm, linear_pending_ref
from pd_ssm.kernels.skinny_gemm_triton import check_dot_tile, dot_cols, pending_row_scale, row_squares
from pd_ssm.kernels.skinny_linear_triton import (
    DOT_TILE,
    FMA_MAX_ROWS,
    LinearTile,
    balanced,
    fma_gemv_main,
    fma_gemv_pre,
    fma_tile,
    gemv_serves,
    linear_triton,
    skinny_linear_triton,
    tile_cols,
)


@triton.jit
def conv_pre(state_ptr, slot, cw_ptr, cb_ptr, c, n_ok, conv_dim, stride_cw_d, stride_cw_k, act: tl.constexpr,
             WIDTH: tl.constexpr, HAS_CONV_BIAS: tl.constexpr):
    """The conv's loads, for a tile of in_proj columns whose conv channels are c (xBC columns where
    0 <= c < conv_dim) in the rows whose state slots are `slot` (broadcast against c: a scalar against
    [BLOCK_N] at one row, [1, BLOCK_M] against [BLOCK_N, 1] in the DOT tile). They may come before
    in_proj's PDL gate: this layer's previous step wrote the state. Returns the state rows' pointers,
    their mask, the channels' mask, the last tap's weight, the history taps' fp32 sum, the bias (0
    without one) and the history taps themselves (a tuple, oldest first: the shift's values)."""
    c_ok = n_ok & (c >= 0) & (c < conv_dim)
    cc = tl.where(c_ok, c, 0)
    st_ok = c_ok & (slot >= 0)  # a negative slot is CUDA-graph padding: touch no state
    row = state_ptr + tl.maximum(slot, 0).to(tl.int64) * conv_dim * (WIDTH - 1) + cc * (WIDTH - 1)
    w_conv = cw_ptr + cc * stride_cw_d
    w_last = tl.load(w_conv + (WIDTH - 1) * stride_cw_k, mask=c_ok, other=0.0)
    # NOTE: the conv update kernel's sum, from 0 with explicit FMAs: where a layout conversion sits
    # between a product and its sum (the DOT tile's epilogue) the compiler would not contract them,
    # and fp32 results would differ from that kernel's in the last bit
    conv = tl.zeros(row.shape, dtype=tl.float32)
    taps = ()  # the WIDTH - 1 loaded taps, a Triton tuple built while the loop unrolls
    for k in tl.static_range(WIDTH - 1):
        hk = tl.load(row + k, mask=st_ok, other=0.0).to(act)
        wk = tl.load(w_conv + k * stride_cw_k, mask=c_ok, other=0.0)
        conv = tl.fma(hk.to(tl.float32), wk.to(tl.float32), conv)
        taps = taps + (hk,)  # type: ignore[assignment]  # (mypy types the empty tuple it starts from)
    if HAS_CONV_BIAS:
        conv_b = tl.load(cb_ptr + cc, mask=c_ok, other=0.0).to(tl.float32)
    else:
        conv_b = 0.0
    return row, st_ok, c_ok, w_last, conv, conv_b, taps


@triton.jit
def has_conv_columns(n0, cols, conv_start, conv_dim):
    """Whether in_proj columns [n0, n0 + cols) hold any xBC channel: the tiles of z and dt columns
    (about half of in_proj's) skip the conv, its barrier, the re-read of their output and its stores."""
    return (n0 < conv_start + conv_dim) & (n0 + cols > conv_start)


@triton.jit
def conv_post(xv, row, st_ok, c_ok, live, w_last, conv, conv_b, taps, xbc_ptrs, state_ptr, WIDTH: tl.constexpr,
              HAS_CONV_BIAS: tl.constexpr, FAST_EXP: tl.constexpr):
    """The conv's finish on in_proj's output xv as it is stored (its new input): the last tap, the
    bias, SiLU into xbc (zeros where not live), and the state row shifted left with xv appended."""
    act = xv.dtype
    conv = tl.fma(xv.to(tl.float32), w_last.to(tl.float32), conv)
    if HAS_CONV_BIAS:
        conv += conv_b
    out = _silu_in(conv.to(act), act, FAST_EXP)
    tl.store(xbc_ptrs, tl.where(live, out, 0.0).to(act), mask=c_ok)
    # shift left from conv_pre's loads (column j <- column j + 1; the newest <- xv), not re-read: one
    # barrier orders every thread's reads of the row (in conv_pre) before any thread's writes. Against
    # a re-read and a barrier a column: the batch-1 chain -0.4 to -2.1 us a layer, 8-32 rows -0.6 to
    # -1.2, the engine's decode steps at batch 1 / 8 / 32 -1.4 / -1.6 / -1.7% (H200, RESULTS.md
    # session 20)
    tl.debug_barrier()
    for j in tl.static_range(WIDTH - 2):
        tl.store(row + j, taps[j + 1].to(state_ptr.dtype.element_ty), mask=st_ok)
    tl.store(row + (WIDTH - 2), xv.to(state_ptr.dtype.element_ty), mask=st_ok)


@triton.jit
def _in_proj_conv_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, y_ptr, state_ptr, slot_ptr, cw_ptr, cb_ptr, xbc_ptr, ss_ptr,
    # dimensions (K is specialized on: a layer's K never changes)
    N, K: tl.constexpr, conv_start, conv_dim, n_ss, eps,
    # strides (the last axes have stride 1; the pool is contiguous: [slot, d, j])
    stride_wn, stride_cw_d, stride_cw_k,
    # a later kernel's L2 hint (l2_prefetch.py)
    pf_ptr, pf_rows, pf_stride, pf_share, pf_lines,
    # meta-parameters
    HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, WIDTH: tl.constexpr, FAST_EXP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
    PRE_K: tl.constexpr, PENDING: tl.constexpr, SS_BLOCK: tl.constexpr, COLS: tl.constexpr,
    PF_ROWS: tl.constexpr, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr,
):
    """One row. PENDING: x is a PendingNorm's (ss_ptr its n_ss partial squares): the GEMV's sums are
    multiplied by the norm's scale (pending_norm.py). A program owns COLS <= BLOCK_N columns."""
    n0 = tl.program_id(0) * COLS
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] in_proj column
    n_ok = (offs_n < N) & (tl.arange(0, BLOCK_N) < COLS)
    act = y_ptr.dtype.element_ty
    # before the GEMV's PDL gate: the slot, the conv weights and the history taps
    slot = tl.load(slot_ptr)
    row, st_ok, c_ok, w_last, conv, conv_b, taps = conv_pre(state_ptr, slot, cw_ptr, cb_ptr, offs_n - conv_start,
                                                            n_ok, conv_dim, stride_cw_d, stride_cw_k, act, WIDTH,
                                                            HAS_CONV_BIAS)
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
    if has_conv_columns(n0, COLS, conv_start, conv_dim):
        conv_post(xv, row, st_ok, c_ok, slot >= 0, w_last, conv, conv_b, taps, xbc_ptr + (offs_n - conv_start),
                  state_ptr, WIDTH, HAS_CONV_BIAS, FAST_EXP)
    prefetch_rows_l2(pf_ptr, pf_rows, pf_stride, pf_share, pf_lines, tl.program_id(0), PF_ROWS, PF_LINES, PF_LINE)


@triton.jit
def _in_proj_conv_dot_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, y_ptr, state_ptr, slot_ptr, cw_ptr, cb_ptr, xbc_ptr, ss_ptr,
    # dimensions (K is specialized on: a layer's K never changes)
    M, N, K: tl.constexpr, conv_start, conv_dim, n_ss, eps,
    # strides (the last axes have stride 1; the pool is contiguous: [slot, d, j])
    stride_xm, stride_wn, stride_ym, stride_xbc, stride_ss, stride_cw_d, stride_cw_k,
    # meta-parameters
    HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, WIDTH: tl.constexpr, FAST_EXP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    INTERPRETED: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, SS_BLOCK: tl.constexpr,
    EARLY_TAPS: tl.constexpr,
):
    """A few rows of a pending norm (x, ss_ptr [M, n_ss] its partial squares): the DOT path's tile
    (skinny_gemm_triton.py) of [BLOCK_N columns, BLOCK_M rows], its sums multiplied by each row's
    norm scale, then the conv of the tile's xBC columns in every row. EARLY_TAPS: the conv's history
    taps are loaded before the PDL gate and held through the stream, else after it."""
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] row
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] in_proj column
    m_ok = offs_m < M
    n_ok = offs_n < N
    # NOTE: the conv works on the GEMM's tile, [BLOCK_N channels, BLOCK_M rows], with in_proj's
    # output taken back from memory (this program's own stores, L1 / L2): Triton lays out a tile whose
    # addresses run along no axis (the state's, 3 elements a channel) with its first axis fastest, so
    # a warp's accesses cover channels of one slot (as the conv update kernel's do). In the tensor
    # cores' layout, or with rows first, each warp instruction spread over 8-32 slots: 42 against
    # 20 us a call at 32 rows (H200, RESULTS.md session 19).
    slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1)[None, :]  # [1, BLOCK_M]; past M: -1, no state
    c = (offs_n - conv_start)[:, None]  # [BLOCK_N, 1] conv channel
    if EARLY_TAPS:  # before the gate: the conv's state and weights were written two launches back or more
        row, st_ok, c_ok, w_last, conv, conv_b, taps = conv_pre(state_ptr, slot, cw_ptr, cb_ptr, c, n_ok[:, None],
                                                                conv_dim, stride_cw_d, stride_cw_k,
                                                                y_ptr.dtype.element_ty, WIDTH, HAS_CONV_BIAS)
    pdl_gate(PDL)  # x and its squares are the launch before's (out_proj_add_triton.py's reduce)
    ss = row_squares(ss_ptr, offs_m, m_ok, stride_ss, n_ss, SS_BLOCK)
    acc = dot_cols(x_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, stride_xm, stride_wn, 0, K, K, BLOCK_M, BLOCK_N,
                   BLOCK_K, NUM_STAGES, K % BLOCK_K != 0, INTERPRETED, IEEE)  # [BLOCK_N, BLOCK_M]
    if not EARLY_TAPS:
        row, st_ok, c_ok, w_last, conv, conv_b, taps = conv_pre(state_ptr, slot, cw_ptr, cb_ptr, c, n_ok[:, None],
                                                                conv_dim, stride_cw_d, stride_cw_k,
                                                                y_ptr.dtype.element_ty, WIDTH, HAS_CONV_BIAS)
    acc *= pending_row_scale(ss, K, eps)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]  # [BLOCK_N, BLOCK_M]
    tile_ok = n_ok[:, None] & m_ok[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=tile_ok)
    n0 = tl.program_id(0) * BLOCK_N
    if has_conv_columns(n0, BLOCK_N, conv_start, conv_dim):
        tl.debug_barrier()  # every thread's stores before any thread's loads
        xv = tl.load(y_ptrs, mask=tile_ok, other=0.0)  # [BLOCK_N, BLOCK_M]
        xbc_ptrs = xbc_ptr + offs_m.to(tl.int64)[None, :] * stride_xbc + c  # [BLOCK_N, BLOCK_M]
        conv_post(xv, row, st_ok, c_ok & m_ok[None, :], slot >= 0, w_last, conv, conv_b, taps, xbc_ptrs, state_ptr,
                  WIDTH, HAS_CONV_BIAS, FAST_EXP)


# NOTE: the conv in the DOT tile's epilogue against its own launch, in the layer chains (H200, 2.7B
# shape, benchmarks/wide_out_proj_gpu.py, RESULTS.md session 19), taps loaded after the stream:
# 8 / 16 rows -3.2 to -3.8 / -2.3 to -3.1 us a layer, 24 / 32 rows +1.2 to +1.6 / +2.1 to +2.2
# (every program's epilogue covers every row, and waits for the taps); loaded before the gate,
# 32 rows -1.1 to -1.4 us, and the engine's batch-32 step 5.207 -> 5.112 ms, while batch 8 lost 4%
# (3.04 against 2.92 ms, its 16-row tile at 158 registers under the cap): taps early from 32-row tiles
DOT_CONV_MAX_ROWS = 32
EARLY_TAPS_BLOCK_M = 32
# NOTE: early taps in a 32-column tile at 32 rows take 190 registers (sm_90; 177 since the shift
# holds its taps), 2 programs per SM; capped at 168 (no spills), 3 per SM hold all 331 of in_proj's.
# A 64-column tile (on wgmma) takes 232 with early taps and 235 without, uncapped (168 spills): its
# shared memory (96 KB) allows 2 programs per SM either way
EARLY_TAPS_MAXNREG = 168
EARLY_TAPS_MAXNREG_BLOCK_N = 32  # the cap applies up to this tile width


def fusable(hidden: Tensor | PendingNorm, weight: Tensor) -> bool:
    """Whether one launch serves this call: one row where the GEMV serves in_proj at all
    (skinny_linear_triton.gemv_serves), or a pending norm of up to DOT_CONV_MAX_ROWS rows (bf16 /
    fp16 on CUDA, stride 1 on K: the DOT path's tile with the conv in its epilogue)."""
    if isinstance(hidden, PendingNorm):
        x = hidden.x
        return (x.is_cuda and x.dim() == 2 and x.shape[0] <= DOT_CONV_MAX_ROWS and x.dtype in (torch.bfloat16,
                torch.float16) and weight.dtype == x.dtype and x.stride(1) == 1 and weight.stride(1) == 1)
    return gemv_serves(hidden, weight) and hidden.shape[0] == 1


_IN_PROJ_CONV = FastKernel(_in_proj_conv_kernel)
_IN_PROJ_CONV_DOT = FastKernel(_in_proj_conv_dot_kernel)


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
    prefetch: L2Rows | None = None,
) -> tuple[Tensor, Tensor]:
    """Triton `in_proj_conv_ref` (shapes there). `fused`: None picks one launch where it serves
    (`fusable`), True forces it (tests, in Triton's interpreter too), False the two launches.
    `tile`, for sweeps: the one-row GEMV's (default skinny_linear_triton.fma_tile's, `balanced` over
    the SMs), or the DOT path's for a pending norm of more rows (default skinny_linear_triton.DOT_TILE).
    `prefetch`: what a later kernel of the layer streams first (out_proj's weight), asked of L2 by each
    program of the one-row launch once its outputs are stored (l2_prefetch.py); it changes no value."""
    pending = hidden if isinstance(hidden, PendingNorm) else None
    if pending is not None:
        check_pending_norm("in_proj_conv", pending)
    if prefetch is not None:
        check_hint("in_proj_conv", prefetch)
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
    if (B != 1 and pending is None) or x.stride(1) != 1 or weight.stride(1) != 1 or weight.dtype != x.dtype:
        raise ValueError("in_proj_conv: one launch takes one row or a pending norm's rows, x and weight of one dtype, "
                         "stride 1 on K")
    proj = torch.empty((B, N), dtype=x.dtype, device=x.device)  # [B, N]
    _check_conv_args("in_proj_conv", proj[:, conv_start:conv_start + conv_dim], conv_weight, conv_bias, conv_state,
                     state_indices, B, "silu")
    xbc = torch.empty((B, conv_dim), dtype=x.dtype, device=x.device)  # [B, conv_dim]
    pdl = use_pdl(x)
    ss = None if pending is None else pending.ss.contiguous()
    n_ss = 0 if ss is None else ss.shape[1]
    eps = 0.0 if pending is None else float(pending.eps)
    conv = dict(HAS_BIAS=bias is not None, HAS_CONV_BIAS=conv_bias is not None, WIDTH=conv_weight.shape[1],
                FAST_EXP=x.is_cuda, PDL=pdl, SS_BLOCK=pow2(n_ss))
    with on_device(x):
        if B == 1:
            t = tile or balanced(fma_tile(N), N, num_sms(x.device))
            cols = tile_cols(t)
            grid = cdiv(N, cols)
            pf = prefetch_args(prefetch, grid)
            _IN_PROJ_CONV[(grid,)](
                x, weight, bias, proj, conv_state, state_indices.contiguous(), conv_weight, conv_bias, xbc, ss,
                N, K, conv_start, conv_dim, n_ss, eps, weight.stride(0), conv_weight.stride(0), conv_weight.stride(1),
                *pf.runtime, BLOCK_N=t.block_n, BLOCK_K=t.block_k, NUM_STAGES=t.num_stages, PRE_K=t.prefetch_k,
                PENDING=pending is not None, COLS=cols, num_warps=t.num_warps, **conv, **pf.meta,
                **launch_options(pdl),
            )
        else:
            assert ss is not None  # checked above: more rows come as a pending norm
            t = tile or DOT_TILE
            check_dot_tile("in_proj_conv", t)
            block_m = min(64, max(16, pow2(B)))
            early = block_m >= EARLY_TAPS_BLOCK_M
            _IN_PROJ_CONV_DOT[(cdiv(N, t.block_n), cdiv(B, block_m))](
                x, weight, bias, proj, conv_state, state_indices.contiguous(), conv_weight, conv_bias, xbc, ss,
                B, N, K, conv_start, conv_dim, n_ss, eps, x.stride(0), weight.stride(0), proj.stride(0),
                xbc.stride(0), ss.stride(0), conv_weight.stride(0), conv_weight.stride(1),
                BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, NUM_STAGES=t.num_stages,
                INTERPRETED=not x.is_cuda, IEEE=x.dtype == torch.float32, num_warps=t.num_warps, **conv,
                EARLY_TAPS=early, **({"maxnreg": EARLY_TAPS_MAXNREG} if early and x.is_cuda
                                     and t.block_n <= EARLY_TAPS_MAXNREG_BLOCK_N else {}),
                **launch_options(pdl),
            )
    return proj, xbc
