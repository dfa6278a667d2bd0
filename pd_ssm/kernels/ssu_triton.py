"""Triton selective state update: one decode step of the Mamba2 SSM per sequence, in place on the pool.

Same signature and numerics as `ssu.selective_state_update_ref`: dt is discretized in fp32 (bias,
softplus with threshold 20, optional clamp), the state is updated in fp32 as
state * exp(dt A) + (dt B) x, y is read off the fp32 state before it is cast to the pool's dtype.

Bandwidth: the state is the only large operand (Mamba2-2.7B: 80 * 64 * 128 fp32 = 2.6 MB per
sequence, read once and written once). Each program streams a [BLOCK_P, dstate] tile of one head
of one sequence; the small operands (x, dt, B, C, A, D, dt_bias) come from L2. Programs are
ordered slot-major (headdim tile fastest, then head, then sequence), so the programs running at
once stream contiguous memory; that order, not the tile size, is what lifted it from ~86% to
91-95% of copy bandwidth (benchmarks/NOTES_small_kernels.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.launch import FastKernel
from pd_ssm.kernels.pdl import launch_options, pdl_gate, use_pdl
from pd_ssm.kernels.ssd import NO_DT_LIMIT
from pd_ssm.kernels.ssu import check_ssu_args


class SSUConfig(NamedTuple):
    block_p: int  # headdim rows per program
    num_warps: int
    slot_major: bool = True  # grid (p, h, b): neighbouring programs stream one slot's contiguous heads
    evict_first: bool = False  # L2 eviction hint on the state load


def default_config(headdim: int, dstate: int, state_dtype: torch.dtype) -> SSUConfig:
    """About 8 KB of state per program, at most the whole head, slot-major grid. On an H200 (fp32
    state, Mamba2-2.7B) tiles of 8-32 rows were within 1% of each other; the slot-major grid gained
    about 5% and the eviction hint nothing (benchmarks/NOTES_small_kernels.md)."""
    rows = max(1, 8192 // (pow2(dstate) * state_dtype.itemsize))
    return SSUConfig(block_p=min(pow2(headdim), rows), num_warps=4)


@triton.jit
def _softplus(v):
    """F.softplus (threshold 20) in fp32, with log1p(u) = log(1 + u) * u / ((1 + u) - 1) (exact to a
    few ulp where u = exp(v) is tiny and log(1 + u) alone would lose it)."""
    u = tl.exp(v)
    w = 1.0 + u
    tiny = w == 1.0
    log1p = tl.where(tiny, u, tl.log(w) * (u / tl.where(tiny, 1.0, w - 1.0)))
    return tl.where(v > 20.0, v, log1p)


@triton.jit
def _ssu_kernel(
    # pointers
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slot_ptr, out_ptr,
    # dimensions
    headdim, dstate, heads_per_group, dt_lo, dt_hi,
    # strides (the pool is contiguous: [slot, h, p, n])
    stride_state_slot, stride_state_head,
    stride_x_b, stride_x_h, stride_dt_b, stride_dt_h,
    stride_B_b, stride_B_g, stride_C_b, stride_C_g, stride_out_b, stride_out_h,
    # meta-parameters
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
    SLOT_MAJOR: tl.constexpr, EVICT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_p = tl.program_id(0)
    if SLOT_MAJOR:
        h = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
    else:
        b = tl.program_id(1).to(tl.int64)
        h = tl.program_id(2)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    p_ok = offs_p < headdim
    n_ok = offs_n < dstate
    out_ptrs = out_ptr + b * stride_out_b + h * stride_out_h + offs_p
    slot = tl.load(slot_ptr + b).to(tl.int64)
    live = slot >= 0  # a negative slot is CUDA-graph padding: touch no state, y = 0
    state_ptrs = (state_ptr + tl.maximum(slot, 0) * stride_state_slot + h * stride_state_head
                  + offs_p[:, None] * dstate + offs_n[None, :])  # [BLOCK_P, BLOCK_N]
    tile_ok = p_ok[:, None] & n_ok[None, :] & live
    # NOTE: issue the big load first; the small operands below hide behind it. Before the PDL
    # gate (pdl.py): the state (last written by this layer's previous step) and the parameters
    state = tl.load(state_ptrs, mask=tile_ok, other=0.0, eviction_policy=EVICT).to(tl.float32)
    A = tl.load(A_ptr + h)
    if HAS_DT_BIAS:
        dt_b = tl.load(dt_bias_ptr + h).to(tl.float32)
    if HAS_D:
        Dh = tl.load(D_ptr + h).to(tl.float32)
    pdl_gate(PDL)
    if not live:
        tl.store(out_ptrs, tl.zeros([BLOCK_P], dtype=out_ptr.dtype.element_ty), mask=p_ok)
        return

    dt = tl.load(dt_ptr + b * stride_dt_b + h * stride_dt_h).to(tl.float32)
    g = h // heads_per_group
    Bv = tl.load(B_ptr + b * stride_B_b + g * stride_B_g + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + offs_p, mask=p_ok, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += dt_b
    if DT_SOFTPLUS:
        dt = _softplus(dt)
    if HAS_DT_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
    dA = tl.exp(dt * A)

    # (dt * B) first, then times x: the reference's order
    state = state * dA + (dt * Bv)[None, :] * xv[:, None]  # [BLOCK_P, BLOCK_N] fp32
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=tile_ok)
    y = tl.sum(state * Cv[None, :], axis=1)  # [BLOCK_P]
    if HAS_D:
        y += xv * Dh
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=p_ok)


def selective_state_update_triton(
    ssm_state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    state_indices: Tensor,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: Sequence[float] = NO_DT_LIMIT,
) -> Tensor:
    """Triton `selective_state_update_ref`: one SSM step for each of Bt sequences.

    Shapes (H = nheads, P = headdim, G = ngroups, N = dstate):
      ssm_state      [num_slots, H, P, N]  state pool (fp32, bf16 or fp16), contiguous
      x              [Bt, H, P]            fp32/bf16/fp16, stride 1 on the last axis
      dt             [Bt, H]               raw, before dt_bias and softplus
      A              [H]                   fp32, already -exp(A_log)
      B, C           [Bt, G, N]            stride 1 on the last axis; head h reads group h // (H // G)
      state_indices  [Bt] int32            pool slot of each sequence; distinct; a negative slot
                                           (CUDA-graph padding) leaves the pool alone, y = 0
      D, dt_bias     [H] or None

    In place on ssm_state[state_indices]. Returns y [Bt, H, P] in x.dtype. One launch, no host
    synchronization (CUDA-graph safe).
    """
    check_ssu_args(ssm_state, x, dt, A, B, C, state_indices, D, dt_bias)
    cfg = default_config(x.shape[2], B.shape[2], ssm_state.dtype)
    return launch_ssu(ssm_state, x, dt, A, B, C, state_indices, D, dt_bias, dt_softplus, dt_limit, cfg)


_SSU = FastKernel(_ssu_kernel)


def launch_ssu(
    ssm_state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state_indices: Tensor,
    D: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool, dt_limit: Sequence[float], cfg: SSUConfig,
) -> Tensor:
    """The launch behind `selective_state_update_triton`, with the tile chosen by the caller (the
    benchmark sweeps it); arguments already checked."""
    Bt, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    out = torch.empty((Bt, H, P), dtype=x.dtype, device=x.device)  # [Bt, H, P]
    if Bt == 0:
        return out
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    pdl = use_pdl(x)
    with on_device(x):
        p_tiles = cdiv(P, cfg.block_p)
        grid = (p_tiles, H, Bt) if cfg.slot_major else (p_tiles, Bt, H)
        _SSU[grid](
            ssm_state, x, dt, A.contiguous(), B, C,
            None if D is None else D.contiguous(), None if dt_bias is None else dt_bias.contiguous(),
            state_indices.contiguous(), out,
            P, N, H // G, lo, hi,
            ssm_state.stride(0), ssm_state.stride(1),
            x.stride(0), x.stride(1), dt.stride(0), dt.stride(1),
            B.stride(0), B.stride(1), C.stride(0), C.stride(1), out.stride(0), out.stride(1),
            HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
            HAS_DT_LIMIT=(lo, hi) != NO_DT_LIMIT, SLOT_MAJOR=cfg.slot_major,
            EVICT="evict_first" if cfg.evict_first else "", BLOCK_P=cfg.block_p,
            BLOCK_N=pow2(N), PDL=pdl, num_warps=cfg.num_warps, **launch_options(pdl),
        )
    return out
