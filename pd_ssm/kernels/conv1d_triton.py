"""Triton causal depthwise conv1d: varlen prefill and one-token decode, in place on the state pool.

Same signatures, layout and numerics as `conv1d.causal_conv1d_varlen_ref` / `causal_conv1d_update_ref`:
the taps accumulate in fp32, the sum (with bias) is rounded once to x.dtype (what F.conv1d returns),
and silu runs in fp32 on that rounded value and rounds again. History read from the pool is
rounded to x.dtype first, and the new history is the x.dtype value cast to the pool's dtype, so a
sequence shorter than width-1 writes back its old history exactly as the reference does.

Neither launcher synchronizes with the host: the varlen kernel finds each token's sequence by a
binary search over cu_seqlens on the device, so the grid depends only on shapes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._checks import check_dtype, check_ndim, check_same_device, check_shape
from pd_ssm.kernels.conv1d import _check_conv_args


def _on_device(t: Tensor) -> AbstractContextManager[object]:
    # NOTE: Triton launches on the current CUDA device, which need not be the tensors' one
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()


@triton.jit
def _silu_in(v, out_dtype):
    """silu of a value already rounded to out_dtype, computed in fp32 and rounded again (F.silu)."""
    f = v.to(tl.float32)
    return (f / (1.0 + tl.exp(-f))).to(out_dtype)


@triton.jit
def _conv_varlen_out_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr, out_ptr,
    # dimensions
    T, dim, num_seqs,
    # strides (the pool is contiguous: [slot, d, j] at slot * dim * (W-1) + d * (W-1) + j)
    stride_x_t, stride_w_d, stride_w_k, stride_out_t,
    # meta-parameters
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] token
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] channel
    t_ok = offs_t < T
    d_ok = offs_d < dim

    # sequence of each token: the largest s with cu[s] <= t (invariant: cu[lo] <= t < cu[hi])
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + num_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid) <= offs_t
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    pos = offs_t - tl.load(cu_ptr + lo)  # [BLOCK_T] position inside its sequence
    slot = tl.load(slot_ptr + lo, mask=t_ok, other=0).to(tl.int64)  # [BLOCK_T]
    has_init = tl.load(init_ptr + lo, mask=t_ok, other=0) != 0  # [BLOCK_T]
    hist_row = state_ptr + slot[:, None] * dim * (WIDTH - 1) + offs_d[None, :] * (WIDTH - 1)

    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(WIDTH):
        # tap k reads input p = pos - shift: x when p >= 0, else history column width-1 + p
        shift = WIDTH - 1 - k
        from_x = pos >= shift  # [BLOCK_T]
        m_x = (t_ok & from_x)[:, None] & d_ok[None, :]
        m_h = (t_ok & ~from_x & has_init)[:, None] & d_ok[None, :]
        xv = tl.load(x_ptr + (offs_t - shift).to(tl.int64)[:, None] * stride_x_t + offs_d[None, :],
                     mask=m_x, other=0.0)
        hv = tl.load(hist_row + (pos + k)[:, None], mask=m_h, other=0.0).to(xv.dtype)
        wk = tl.load(w_ptr + offs_d * stride_w_d + k * stride_w_k, mask=d_ok, other=0.0)  # [BLOCK_D]
        acc += tl.where(from_x[:, None], xv, hv).to(tl.float32) * wk.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    if SILU:
        y = _silu_in(y, out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_out_t + offs_d[None, :], y,
             mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def _conv_varlen_state_kernel(
    # pointers
    x_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr,
    # dimensions
    dim,
    # strides
    stride_x_t,
    # meta-parameters
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """state[slot] <- the last width-1 entries of (history ++ x[seq]); runs after the output kernel."""
    s = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    offs_j = tl.arange(0, BLOCK_J)  # [BLOCK_J] state column, BLOCK_J >= width-1
    start = tl.load(cu_ptr + s)
    length = tl.load(cu_ptr + s + 1) - start
    has_init = tl.load(init_ptr + s) != 0
    row = state_ptr + tl.load(slot_ptr + s).to(tl.int64) * dim * (WIDTH - 1) + offs_d[:, None] * (WIDTH - 1)
    ok = (offs_d < dim)[:, None] & (offs_j < WIDTH - 1)[None, :]  # [BLOCK_D, BLOCK_J]
    # column j takes entry e = length + j of history ++ x:
    #   history[e] if e < width-1, else x[start + e - (width-1)]
    e = length + offs_j  # [BLOCK_J]
    from_x = (e >= WIDTH - 1)[None, :]
    xv = tl.load(x_ptr + (start + e - (WIDTH - 1)).to(tl.int64)[None, :] * stride_x_t + offs_d[:, None],
                 mask=ok & from_x, other=0.0)
    hv = tl.load(row + e[None, :], mask=ok & ~from_x & has_init, other=0.0).to(xv.dtype)
    new = tl.where(from_x, xv, hv).to(state_ptr.dtype.element_ty)  # [BLOCK_D, BLOCK_J]
    # NOTE: a short sequence shifts its own history left, so columns read above are written below;
    # the barrier orders every read of the block before any write
    tl.debug_barrier()
    tl.store(row + offs_j[None, :], new, mask=ok)


@triton.jit
def _conv_update_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, state_ptr, slot_ptr, out_ptr,
    # dimensions
    dim,
    # strides
    stride_x_b, stride_w_d, stride_w_k, stride_out_b,
    # meta-parameters
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    offs_j = tl.arange(0, BLOCK_J)  # [BLOCK_J] state column, BLOCK_J >= width-1
    d_ok = offs_d < dim
    ok = d_ok[:, None] & (offs_j < WIDTH - 1)[None, :]  # [BLOCK_D, BLOCK_J]
    slot = tl.load(slot_ptr + b).to(tl.int64)
    out_ptrs = out_ptr + b.to(tl.int64) * stride_out_b + offs_d
    if slot < 0:  # CUDA-graph padding: touch no state
        tl.store(out_ptrs, tl.zeros([BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=d_ok)
        return
    row = state_ptr + slot * dim * (WIDTH - 1) + offs_d[:, None] * (WIDTH - 1)
    xv = tl.load(x_ptr + b.to(tl.int64) * stride_x_b + offs_d, mask=d_ok, other=0.0)  # [BLOCK_D]
    hist = tl.load(row + offs_j[None, :], mask=ok, other=0.0).to(xv.dtype)  # [BLOCK_D, BLOCK_J]
    # window = history (oldest first) ++ x; tap k < width-1 reads history[k], the last tap x
    w_hist = tl.load(w_ptr + offs_d[:, None] * stride_w_d + offs_j[None, :] * stride_w_k, mask=ok, other=0.0)
    w_last = tl.load(w_ptr + offs_d * stride_w_d + (WIDTH - 1) * stride_w_k, mask=d_ok, other=0.0)
    acc = tl.sum(hist.to(tl.float32) * w_hist.to(tl.float32), axis=1)
    acc += xv.to(tl.float32) * w_last.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty)
    if SILU:
        y = _silu_in(y, out_ptr.dtype.element_ty)
    tl.store(out_ptrs, y, mask=d_ok)
    # new column j = window[j + 1]: history[j + 1], or x for the last column
    shifted = tl.load(row + (offs_j + 1)[None, :], mask=ok & (offs_j < WIDTH - 2)[None, :], other=0.0)
    new = tl.where((offs_j == WIDTH - 2)[None, :], xv[:, None], shifted.to(xv.dtype))
    tl.debug_barrier()  # NOTE: every history read of the block precedes the shifted writes
    tl.store(row + offs_j[None, :], new.to(state_ptr.dtype.element_ty), mask=ok)


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
      cu_seqlens         [S+1] int32                 token offsets; every sequence has >= 1 token
      state_indices      [S] int32                   pool slot of each sequence; distinct
      has_initial_state  [S] bool                    False: zeros as history, whatever the slot holds

    Returns out [T, dim] in x.dtype. Two launches (outputs, then states, so that every history is
    read before any is overwritten); no host synchronization, so cu_seqlens is trusted, not checked.
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


class ConvTile(NamedTuple):
    block_t: int  # tokens per program
    block_d: int  # channels per program
    num_warps: int


# NOTE: the best of five tiles on an H200 for 1 x 2048 and 16 x 128 tokens at conv_dim 5376 (bf16);
# benchmarks/NOTES_small_kernels.md
VARLEN_TILE = ConvTile(8, 128, 4)


def launch_conv_varlen(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, cu_seqlens: Tensor,
    state_indices: Tensor, has_initial_state: Tensor, activation: str | None, tile: ConvTile,
) -> Tensor:
    """The launches behind `causal_conv1d_varlen_triton`, with the output tile chosen by the caller
    (the benchmark sweeps it); arguments already checked."""
    T, dim = x.shape
    num_seqs = cu_seqlens.shape[0] - 1
    width = weight.shape[1]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, dim]
    cu = cu_seqlens.contiguous()
    slots = state_indices.contiguous()
    init = has_initial_state.contiguous()
    block_d = min(tile.block_d, triton.next_power_of_2(dim))
    with _on_device(x):
        if T > 0:
            _conv_varlen_out_kernel[(triton.cdiv(T, tile.block_t), triton.cdiv(dim, block_d))](
                x, weight, bias, conv_state, cu, slots, init, out,
                T, dim, num_seqs,
                x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
                WIDTH=width, HAS_BIAS=bias is not None, SILU=activation == "silu",
                SEARCH_STEPS=max(1, num_seqs.bit_length()), BLOCK_T=tile.block_t, BLOCK_D=block_d,
                num_warps=tile.num_warps,
            )
        state_block_d = min(128, triton.next_power_of_2(dim))
        _conv_varlen_state_kernel[(num_seqs, triton.cdiv(dim, state_block_d))](
            x, conv_state, cu, slots, init,
            dim, x.stride(0),
            WIDTH=width, BLOCK_D=state_block_d, BLOCK_J=triton.next_power_of_2(width - 1),
            num_warps=4 if state_block_d >= 128 else 1,
        )
    return out


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
    B, dim = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # [B, dim]
    if B == 0:
        return out
    block_d = min(256, triton.next_power_of_2(dim))
    with _on_device(x):
        _conv_update_kernel[(B, triton.cdiv(dim, block_d))](
            x, weight, bias, conv_state, state_indices.contiguous(), out,
            dim, x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
            WIDTH=weight.shape[1], HAS_BIAS=bias is not None, SILU=activation == "silu",
            BLOCK_D=block_d, BLOCK_J=triton.next_power_of_2(weight.shape[1] - 1),
            num_warps=max(1, min(2, block_d // 128)),
        )
    return out
