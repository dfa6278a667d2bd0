"""Triton causal depthwise conv1d over a varlen batch (prefill), in place on the state pool.

Two launches, neither reading cu_seqlens on the host:

1. `_conv_stencil_kernel` treats x as ONE sequence with no history: every output row is the
   conv of x rows t-(width-1)..t. That is already right for every token at position >= width-1
   inside its sequence (its window lies in its own sequence), which is nearly all of them. It
   never looks at cu_seqlens: no per-token search, no history gather, no masks inside the tile
   (rows are clamped to [0, T); clamped rows feed only tokens launch 2 rewrites). A program walks
   BLOCK_T rows keeping the last width-1 rows in registers, so per output element: one load (a
   16-byte vector per 8 bf16), one conversion, width FMAs; int64 only per row.
2. `_conv_boundary_kernel`, one program per (sequence, channel block), rewrites the outputs of
   the first min(len, width-1) tokens of its sequence with the history from the pool, then writes
   the sequence's new history into its slot. It runs after launch 1 (stream order), so its rows
   win; it reads every history element of its block before writing any.

A zero-length sequence (repeated offsets: a CUDA-graph step padded with empty sequences) owns no
rows and touches no slot; a negative slot (padding) reads zeros as history and writes nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._checks import check_dtype, check_ndim, check_same_device, check_shape
from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.conv1d import _check_conv_args
from pd_ssm.kernels.launch import FastKernel


@triton.jit
def _silu_in(v, out_dtype, FAST_EXP: tl.constexpr):
    """silu of a value already rounded to out_dtype, computed in fp32 and rounded again (F.silu).

    FAST_EXP (GPU only: the interpreter runs no inline asm) takes exp(-f) as ex2.approx.ftz of
    f * -log2(e): what tl.exp emits (the same fp32 product, the same MUFU.EX2) minus ptxas's
    rescaling for denormal inputs and results, 3 of ~24 instructions per element. Bit-identical:
    a denormal input gives 1 and a denormal result only meets 1 + it, which rounds to 1 either way.
    """
    f = v.to(tl.float32)
    if FAST_EXP:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [f * -1.4426950408889634],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        e = tl.exp(-f)
    return (f / (1.0 + e)).to(out_dtype)


@triton.jit
def _conv_stencil_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, out_ptr,
    # dimensions
    T, dim,
    # strides
    stride_x_t, stride_w_d, stride_w_k, stride_out_t,
    # meta-parameters
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, FAST_EXP: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """BLOCK_T consecutive rows x BLOCK_D channels, one row at a time: the last width-1 input rows
    stay in registers as fp32 (a tuple shifted by one each row), so every x element is loaded and
    converted once, plus width-1 halo rows per program."""
    # NOTE: a 1-D grid (a grid's y axis stops at 65535 row blocks) with channel blocks fastest, so
    # programs resident together stream whole rows
    num_d_blocks = tl.cdiv(dim, BLOCK_D)
    pid = tl.program_id(0)
    offs_d = (pid % num_d_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] channel
    t0 = (pid // num_d_blocks) * BLOCK_T
    d_ok = offs_d < dim
    x_cols = x_ptr + offs_d  # [BLOCK_D]
    out_cols = out_ptr + offs_d  # [BLOCK_D]
    w_cols = w_ptr + offs_d * stride_w_d  # [BLOCK_D]
    # NOTE: mypy types `()` as the empty tuple for good, hence the ignores on the tuples grown below
    taps = ()  # WIDTH x [BLOCK_D] fp32 weights, oldest input's tap first
    for k in tl.static_range(WIDTH):
        taps = taps + (tl.load(w_cols + k * stride_w_k, mask=d_ok, other=0.0).to(tl.float32),)  # type: ignore[assignment]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    # halo rows t0-(W-1) .. t0-1; rows before 0 clamp to row 0: they feed only tokens at positions
    # < width-1, which the boundary kernel rewrites. Rows past T re-read row T-1, never stored.
    win = ()  # the last WIDTH-1 input rows, oldest first: WIDTH-1 x [BLOCK_D] fp32
    for j in tl.static_range(WIDTH - 1):
        r = tl.minimum(tl.maximum(t0 - (WIDTH - 1) + j, 0), T - 1).to(tl.int64)
        if EVEN_D:
            v = tl.load(x_cols + r * stride_x_t)
        else:
            v = tl.load(x_cols + r * stride_x_t, mask=d_ok, other=0.0)
        win = win + (v.to(tl.float32),)  # type: ignore[assignment]
    for i in tl.static_range(BLOCK_T):
        r = tl.minimum(t0 + i, T - 1).to(tl.int64)
        if EVEN_D:
            cur = tl.load(x_cols + r * stride_x_t).to(tl.float32)
        else:
            cur = tl.load(x_cols + r * stride_x_t, mask=d_ok, other=0.0).to(tl.float32)
        # NOTE: taps in order, from zero, as the boundary kernel sums them (same fp32 roundings)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(WIDTH - 1):
            acc += win[k] * taps[k]
        acc += cur * taps[WIDTH - 1]
        if HAS_BIAS:
            acc += bias
        y = acc.to(out_ptr.dtype.element_ty)
        if SILU:
            y = _silu_in(y, out_ptr.dtype.element_ty, FAST_EXP)
        row_ok = t0 + i < T
        if EVEN_D:
            tl.store(out_cols + (t0 + i).to(tl.int64) * stride_out_t, y, mask=row_ok)
        else:
            tl.store(out_cols + (t0 + i).to(tl.int64) * stride_out_t, y, mask=d_ok & row_ok)
        win = win[1:] + (cur,)  # type: ignore[assignment]


@triton.jit
def _conv_boundary_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr, out_ptr,
    # dimensions
    dim,
    # strides (the pool is contiguous: [slot, d, j] at slot * dim * (W-1) + d * (W-1) + j)
    stride_x_t, stride_w_d, stride_w_k, stride_out_t,
    # meta-parameters
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, FAST_EXP: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """Head outputs (positions < width-1) with history, then state[slot] <- the last width-1
    entries of (history ++ x[seq])."""
    s = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] channel
    offs_j = tl.arange(0, BLOCK_J)  # [BLOCK_J] head position p, or state column j; BLOCK_J >= W-1
    start = tl.load(cu_ptr + s)
    length = tl.load(cu_ptr + s + 1) - start
    if length <= 0:  # an empty sequence (graph padding) owns no rows and touches no slot
        return
    slot = tl.load(slot_ptr + s)
    live = slot >= 0  # a negative slot is padding: zeros as history, nothing written
    has_hist = (tl.load(init_ptr + s) != 0) & live
    d_ok = offs_d < dim
    row = state_ptr + tl.maximum(slot, 0).to(tl.int64) * dim * (WIDTH - 1) + offs_d[:, None] * (WIDTH - 1)
    x_cols = x_ptr + offs_d[:, None]  # [BLOCK_D, 1]; a column's row offset is added per entry

    # entry e of (history ++ x[seq]): history column e if e < W-1, else x row start + e - (W-1)
    # head token p reads entries p..p+W-1 (tap k: entry p + k)
    head = d_ok[:, None] & ((offs_j < length) & (offs_j < WIDTH - 1))[None, :]  # [BLOCK_D, BLOCK_J]
    acc = tl.zeros([BLOCK_D, BLOCK_J], dtype=tl.float32)
    for k in tl.static_range(WIDTH):
        e = offs_j + k  # [BLOCK_J]
        from_x = (e >= WIDTH - 1)[None, :]
        xv = tl.load(x_cols + ((start + e - (WIDTH - 1)).to(tl.int64) * stride_x_t)[None, :],
                     mask=head & from_x, other=0.0)
        hv = tl.load(row + e[None, :], mask=head & ~from_x & has_hist, other=0.0).to(xv.dtype)
        wk = tl.load(w_ptr + offs_d * stride_w_d + k * stride_w_k, mask=d_ok, other=0.0)  # [BLOCK_D]
        acc += tl.where(from_x, xv, hv).to(tl.float32) * wk.to(tl.float32)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[:, None]
    y = acc.to(out_ptr.dtype.element_ty)
    if SILU:
        y = _silu_in(y, out_ptr.dtype.element_ty, FAST_EXP)
    tl.store(out_ptr + ((start + offs_j).to(tl.int64) * stride_out_t)[None, :] + offs_d[:, None], y, mask=head)

    # new state column j takes entry length + j (a sequence shorter than W-1 keeps old history)
    ok = d_ok[:, None] & (offs_j < WIDTH - 1)[None, :]  # [BLOCK_D, BLOCK_J]
    e = length + offs_j  # [BLOCK_J]
    from_x = (e >= WIDTH - 1)[None, :]
    xv = tl.load(x_cols + ((start + e - (WIDTH - 1)).to(tl.int64) * stride_x_t)[None, :],
                 mask=ok & from_x, other=0.0)
    hv = tl.load(row + e[None, :], mask=ok & ~from_x & has_hist, other=0.0).to(xv.dtype)
    new = tl.where(from_x, xv, hv).to(state_ptr.dtype.element_ty)  # [BLOCK_D, BLOCK_J]
    # NOTE: a short sequence shifts its own history left, so columns read above are written below;
    # the barrier orders every read of the block before any write
    tl.debug_barrier()
    tl.store(row + offs_j[None, :], new, mask=ok & live)


class ConvTile(NamedTuple):
    block_t: int  # tokens per program (stencil kernel)
    block_d: int  # channels per program
    num_warps: int


# NOTE: chosen without a GPU (benchmarks/conv_gpu.py sweeps it on an H200). ptxas for sm_90, bf16,
# width 4: 94 registers, no spills, ~21 SASS instructions per output element (a [16, 256] tile
# re-loading x for each tap: 35, of which 4 loads and 4 bf16 -> fp32 conversions per output); one
# 16-byte load per thread per row; 21 channel blocks x 128 row blocks at 1 x 2048 = 2688 one-warp
# programs, all resident at once (~20 per SM)
# Measured (benchmarks/conv_gpu.py, H200, CUDA graph, bf16): 16 x 128 is the fastest of five
# tiles, 28.4 us at 1 x 2048 (1.55 TB/s) and 29.3 us at 16 x 128 with history, against 33.3 / 35.2 us
# for 16 x 256 and 50.6 / 49.7 us for the kernel this replaced
VARLEN_TILE = ConvTile(16, 128, 1)
_BOUNDARY_BLOCK_D = 128


def causal_conv1d_varlen_triton(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    *,
    cu_seqlens: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    activation: str | None = "silu",
) -> Tensor:
    """Triton `causal_conv1d_varlen_ref`: same shapes, semantics and in-place state update.

    Shapes:
      x                  [T, dim]                    fp32/bf16/fp16, stride 1 on the last axis
      weight             [dim, width]                dtype of x
      bias               [dim] or None               dtype of x
      conv_state         [num_slots, dim, width-1]   pool, contiguous
      cu_seqlens         [S+1] int32                 token offsets, non-decreasing from 0 to T
      state_indices      [S] int32                   pool slot of each sequence; distinct
      has_initial_state  [S] bool                    False: zeros as history, whatever the slot holds

    Beyond the reference (which requires >= 1 token per sequence): a zero-length sequence touches
    nothing, whatever its slot; a negative slot reads zeros as history and writes nothing (padding).
    Returns out [T, dim] in x.dtype. Two launches, no host synchronization (CUDA-graph safe), so
    cu_seqlens is trusted, not checked.
    """
    k = "causal_conv1d_varlen"
    num_seqs = cu_seqlens.shape[0] - 1
    _check_conv_args(k, x, weight, bias, conv_state, state_indices, num_seqs, activation)
    check_ndim(k, "cu_seqlens", cu_seqlens, "[S+1]")
    check_dtype(k, "cu_seqlens", cu_seqlens, (torch.int32,))
    check_shape(k, "has_initial_state", has_initial_state, "[S]", (num_seqs,))
    check_dtype(k, "has_initial_state", has_initial_state, (torch.bool,))
    check_same_device(k, x=x, cu_seqlens=cu_seqlens, has_initial_state=has_initial_state)
    if num_seqs < 1:
        raise ValueError(f"{k}: cu_seqlens must hold at least one sequence, got {tuple(cu_seqlens.shape)}")
    return launch_conv_varlen(x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state,
                              activation, VARLEN_TILE)


_CONV_BOUNDARY = FastKernel(_conv_boundary_kernel)
_CONV_STENCIL = FastKernel(_conv_stencil_kernel)


def launch_conv_varlen(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, cu_seqlens: Tensor,
    state_indices: Tensor, has_initial_state: Tensor, activation: str | None, tile: ConvTile,
) -> Tensor:
    """The launches behind `causal_conv1d_varlen_triton`, with the stencil tile chosen by the caller
    (the benchmarks sweep it); arguments already checked."""
    T, dim = x.shape
    num_seqs = cu_seqlens.shape[0] - 1
    width = weight.shape[1]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, dim]
    block_d = min(tile.block_d, pow2(dim))
    meta = dict(WIDTH=width, HAS_BIAS=bias is not None, SILU=activation == "silu", FAST_EXP=x.is_cuda)
    with on_device(x):
        if T > 0:
            _CONV_STENCIL[(cdiv(dim, block_d) * cdiv(T, tile.block_t),)](
                x, weight, bias, out,
                T, dim,
                x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
                **meta, EVEN_D=dim % block_d == 0, BLOCK_T=tile.block_t, BLOCK_D=block_d,
                num_warps=tile.num_warps,
            )
        bd = min(_BOUNDARY_BLOCK_D, pow2(dim))
        _CONV_BOUNDARY[(num_seqs, cdiv(dim, bd))](
            x, weight, bias, conv_state, cu_seqlens.contiguous(), state_indices.contiguous(),
            has_initial_state.contiguous(), out,
            dim,
            x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
            **meta, BLOCK_D=bd, BLOCK_J=pow2(width - 1),
            num_warps=4 if bd >= 128 else 1,
        )
    return out
