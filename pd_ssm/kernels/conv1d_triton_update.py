"""Triton causal depthwise conv1d, one new token per sequence (decode), in place on the state pool.

A state row [d, 0:width-1] is width-1 elements (6 or 12 bytes), too short and misaligned for vector
loads, so the kernel works on [BLOCK_D] channel vectors, one per state column: each column is one
strided load per channel, coalesced across the warp (the old [BLOCK_D, 4] tile split a channel's
row over threads, masked a quarter of its lanes and re-read columns through DRAM latency), and the
shift left re-reads columns from L1 after every first load has returned. The weights, the slot and
the state columns are loaded before the PDL gate (pdl.py), while in_proj, which writes x, still
runs; x after it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.conv1d import _check_conv_args
from pd_ssm.kernels.conv1d_triton_varlen import _silu_in
from pd_ssm.kernels.launch import FastKernel
from pd_ssm.kernels.pdl import launch_options, pdl_gate, use_pdl


@triton.jit
def _conv_update_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, state_ptr, slot_ptr, out_ptr,
    # dimensions
    dim,
    # strides (the pool is contiguous: [slot, d, j] at slot * dim * (W-1) + d * (W-1) + j)
    stride_x_b, stride_w_d, stride_w_k, stride_out_b,
    # meta-parameters
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, FAST_EXP: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    # NOTE: channel blocks are the fast grid axis: programs resident together cover one slot's
    # contiguous dim * (W-1) state block rather than small pieces of many slots
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] channel
    b = tl.program_id(1).to(tl.int64)
    d_ok = offs_d < dim
    # before the PDL gate (pdl.py): everything but x, which the launch before this one writes;
    # the pool row was last written by this layer's previous step
    w_row = w_ptr + offs_d * stride_w_d  # [BLOCK_D]
    w_last = tl.load(w_row + (WIDTH - 1) * stride_w_k, mask=d_ok, other=0.0)
    slot = tl.load(slot_ptr + b)
    live = slot >= 0  # a negative slot is CUDA-graph padding: touch no state, output zeros
    st_ok = d_ok & live
    row = state_ptr + tl.maximum(slot, 0).to(tl.int64) * dim * (WIDTH - 1) + offs_d * (WIDTH - 1)  # [BLOCK_D]

    # window = history (oldest first) ++ x; tap k < width-1 reads state column k, the last tap x
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(WIDTH - 1):
        hk = tl.load(row + k, mask=st_ok, other=0.0).to(out_ptr.dtype.element_ty)
        wk = tl.load(w_row + k * stride_w_k, mask=d_ok, other=0.0)
        acc = tl.fma(hk.to(tl.float32), wk.to(tl.float32), acc)  # explicit: in_proj_conv_triton sums alike
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    pdl_gate(PDL)
    xv = tl.load(x_ptr + b * stride_x_b + offs_d, mask=d_ok, other=0.0)  # [BLOCK_D]
    acc = tl.fma(xv.to(tl.float32), w_last.to(tl.float32), acc)
    if HAS_BIAS:
        acc += bias
    y = acc.to(out_ptr.dtype.element_ty)
    if SILU:
        y = _silu_in(y, out_ptr.dtype.element_ty, FAST_EXP)
    tl.store(out_ptr + b * stride_out_b + offs_d, tl.where(live, y, 0.0).to(out_ptr.dtype.element_ty), mask=d_ok)

    # shift left: column j <- column j + 1 (re-read from L1, where the loads above left it), the
    # newest column <- x; history values pass through x.dtype. NOTE: each barrier orders every
    # read of a column (whichever thread the layout gives it to) before that column is written
    for j in tl.static_range(WIDTH - 2):
        nxt = tl.load(row + (j + 1), mask=st_ok, other=0.0).to(xv.dtype)
        tl.debug_barrier()
        tl.store(row + j, nxt.to(state_ptr.dtype.element_ty), mask=st_ok)
    tl.debug_barrier()
    tl.store(row + (WIDTH - 2), xv.to(state_ptr.dtype.element_ty), mask=st_ok)


class UpdateTile(NamedTuple):
    block_d: int  # channels per program; >= 32 * num_warps so no channel has two owner threads
    num_warps: int


def default_update_tile(batch: int) -> UpdateTile:
    """128 channels, one warp per program, at every batch size: the fastest of three tiles in the
    CUDA-graph sweep of benchmarks/conv_gpu.py on an H200 (RESULTS.md, 2026-11-30), bf16 pool:
    2.46 / 3.72 / 8.59 / 14.46 us at batch 1 / 32 / 128 / 256 (the wider tiles: 3.2-4.4 / 4.5-6.2 /
    9.5-13.3 / 15.3-23.7 us). More, smaller programs keep more rows' loads in flight."""
    return UpdateTile(128, 1)


def causal_conv1d_update_triton(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    state_indices: Tensor,
    activation: str | None = "silu",
) -> Tensor:
    """Triton `causal_conv1d_update_ref`: one new token for each of B sequences (decode).

    Shapes:
      x              [B, dim]                    fp32/bf16/fp16, stride 1 on the last axis
      conv_state     [num_slots, dim, width-1]   pool, contiguous
      weight         [dim, width]                dtype of x
      bias           [dim] or None               dtype of x
      state_indices  [B] int32                   pool slot of each sequence; distinct; a negative
                                                 slot (CUDA-graph padding) leaves the pool alone
                                                 and gives zeros

    Returns out [B, dim] in x.dtype. One launch, no host synchronization (CUDA-graph safe).
    """
    k = "causal_conv1d_update"
    _check_conv_args(k, x, weight, bias, conv_state, state_indices, x.shape[0], activation)
    return launch_conv_update(x, conv_state, weight, bias, state_indices, activation,
                              default_update_tile(x.shape[0]))


_CONV_UPDATE = FastKernel(_conv_update_kernel)


def launch_conv_update(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None, state_indices: Tensor,
    activation: str | None, tile: UpdateTile,
) -> Tensor:
    """The launch behind `causal_conv1d_update_triton` with the tile chosen by the caller (the
    benchmark sweeps it); arguments already checked."""
    B, dim = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # [B, dim]
    if B == 0:
        return out
    block_d = min(tile.block_d, max(32, pow2(dim)))
    # NOTE: a channel held by two threads would race (one thread's shift overwrites a column the
    # other has yet to read), so the block never has fewer channels than threads
    num_warps = max(1, min(tile.num_warps, block_d // 32))
    pdl = use_pdl(x)
    with on_device(x):
        _CONV_UPDATE[(cdiv(dim, block_d), B)](
            x, weight, bias, conv_state, state_indices.contiguous(), out,
            dim,
            x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
            WIDTH=weight.shape[1], HAS_BIAS=bias is not None, SILU=activation == "silu", FAST_EXP=x.is_cuda,
            BLOCK_D=block_d, PDL=pdl,
            num_warps=num_warps, **launch_options(pdl),
        )
    return out
