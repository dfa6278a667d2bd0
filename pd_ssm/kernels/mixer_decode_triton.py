"""Triton `mamba2_decode_step_ref`: conv update, state update and gate of a decode step in one launch.

Each program owns a [BLOCK_P, dstate] tile of one head's state of one sequence (the grid and
the tile of ssu_triton.py, slot-major, which reach 91-95% of copy bandwidth), and computes in
registers what the three separate kernels passed through memory: the conv of its BLOCK_P x
channels and of its group's B and C (dstate channels each, recomputed by every program of the
sequence: a few KB from L2), the state update, y, the gate, and the tile's sum of squares.

The conv state of the x channels is disjoint between programs, so each shifts its own. The B and
C channels are read by every program of a sequence, so none may shift them before all have read
them: each program counts itself in `arrivals[b]` (an atomic after a barrier; by batch row, not
slot, so CUDA-graph padding rows sharing the scratch slot keep separate counts), and the last one
to arrive shifts B and C and resets the counter to 0 for the next launch. The other configuration
(`fuse_conv=False`) runs the conv update as its own launch first and reads its output.

Arithmetic: the conv as conv1d_triton_update.py (fp32 taps, rounded to the activation dtype, silu
in it), the update and y as ssu_triton.py, h and g as rmsnorm_triton.py's deferred gated norm --
the same operations in the same order, so g equals the three-kernel path's to the bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels.conv1d import _check_conv_args
from pd_ssm.kernels.conv1d_triton_update import default_update_tile, launch_conv_update
from pd_ssm.kernels.conv1d_triton_varlen import _silu_in
from pd_ssm.kernels.mixer_decode import check_mixer_decode_args
from pd_ssm.kernels.rmsnorm import GatedSquares
from pd_ssm.kernels.ssu import check_ssu_args
from pd_ssm.kernels.ssu_triton import _on_device, _softplus
from pd_ssm.kernels.ssu_triton import default_config as ssu_config


class DecodeStepConfig(NamedTuple):
    block_p: int  # headdim rows per program
    num_warps: int
    fuse_conv: bool  # the conv inside (B/C elected) or one conv-update launch before


def default_config(batch: int, headdim: int, dstate: int, state_dtype: torch.dtype) -> DecodeStepConfig:
    """The state update's tile (ssu_triton.default_config) with the conv fused."""
    ssu = ssu_config(headdim, dstate, state_dtype)
    return DecodeStepConfig(ssu.block_p, ssu.num_warps, True)


@triton.jit
def _conv_silu(xbc_row, hist_row, w_ptr, bias_ptr, c, ok, stride_w_d, stride_w_k,
               WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_EXP: tl.constexpr):
    """silu(conv) of channels c for the new input at xbc_row[c] and the history hist_row[c, :]."""
    xv = tl.load(xbc_row + c, mask=ok, other=0.0)
    w_row = w_ptr + c * stride_w_d
    acc = tl.zeros(c.shape, dtype=tl.float32)
    for k in tl.static_range(WIDTH - 1):
        hk = tl.load(hist_row + c * (WIDTH - 1) + k, mask=ok, other=0.0).to(xv.dtype)
        acc += hk.to(tl.float32) * tl.load(w_row + k * stride_w_k, mask=ok, other=0.0).to(tl.float32)
    acc += xv.to(tl.float32) * tl.load(w_row + (WIDTH - 1) * stride_w_k, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=ok, other=0.0).to(tl.float32)
    return _silu_in(acc.to(xv.dtype), xv.dtype, FAST_EXP)


@triton.jit
def _shift_history(xbc_row, hist_row, c, ok, WIDTH: tl.constexpr):
    """History of channels c shifts left by one and takes the new input as its newest column.
    NOTE: each barrier orders every read of a column before that column is written (a channel
    may be held by several threads)."""
    dtype = hist_row.dtype.element_ty
    for j in tl.static_range(WIDTH - 2):
        nxt = tl.load(hist_row + c * (WIDTH - 1) + (j + 1), mask=ok, other=0.0)
        tl.debug_barrier()
        tl.store(hist_row + c * (WIDTH - 1) + j, nxt, mask=ok)
    tl.debug_barrier()
    tl.store(hist_row + c * (WIDTH - 1) + (WIDTH - 2), tl.load(xbc_row + c, mask=ok, other=0.0).to(dtype), mask=ok)


@triton.jit
def _mixer_decode_kernel(
    # pointers
    proj_ptr, conved_ptr, conv_state_ptr, conv_w_ptr, conv_b_ptr, state_ptr, A_ptr, D_ptr, dt_bias_ptr,
    norm_w_ptr, slot_ptr, arrivals_ptr, g_ptr, sq_ptr,
    # dimensions
    headdim, dstate, heads_per_group, d_inner, conv_dim, gn,
    # strides (both pools contiguous: conv [slot, d, j], state [slot, h, p, n])
    stride_proj_b, stride_conved_b, stride_w_d, stride_w_k, stride_state_slot, stride_state_head, stride_g_b,
    stride_sq_b,
    # meta-parameters
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    FUSE_CONV: tl.constexpr, FAST_EXP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_BC: tl.constexpr,
):
    # FUSE_CONV: the conv runs here (B/C elected, module docstring); otherwise conved_ptr holds the
    # conv update's output [B, conv_dim] (x | B | C after silu) and no conv state is touched
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P] headdim row
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N] dstate column
    p_ok = offs_p < headdim
    n_ok = offs_n < dstate
    c_x = h * headdim + offs_p  # [BLOCK_P] channel in z, in x (xBC) and in g
    g_ptrs = g_ptr + b * stride_g_b + c_x
    sq_out = sq_ptr + b * stride_sq_b + h * tl.num_programs(0) + pid_p
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if slot < 0:  # CUDA-graph padding: touch no state
        tl.store(g_ptrs, tl.zeros([BLOCK_P], dtype=g_ptr.dtype.element_ty), mask=p_ok)
        tl.store(sq_out, 0.0)
        return
    state_ptrs = (state_ptr + slot * stride_state_slot + h * stride_state_head
                  + offs_p[:, None] * dstate + offs_n[None, :])  # [BLOCK_P, BLOCK_N]
    tile_ok = p_ok[:, None] & n_ok[None, :]
    # NOTE: issue the big load first; the conv and the small operands hide behind it
    state = tl.load(state_ptrs, mask=tile_ok, other=0.0).to(tl.float32)

    proj_row = proj_ptr + b * stride_proj_b
    xbc_row = proj_row + d_inner
    hist_row = conv_state_ptr + slot * conv_dim * (WIDTH - 1)
    c_B = (h // heads_per_group) * dstate + offs_n  # [BLOCK_N] channels of B in x | B | C, less d_inner
    if FUSE_CONV:
        xv = _conv_silu(xbc_row, hist_row, conv_w_ptr, conv_b_ptr, c_x, p_ok, stride_w_d, stride_w_k,
                        WIDTH, HAS_BIAS, FAST_EXP).to(tl.float32)
        Bv = _conv_silu(xbc_row, hist_row, conv_w_ptr, conv_b_ptr, d_inner + c_B, n_ok, stride_w_d, stride_w_k,
                        WIDTH, HAS_BIAS, FAST_EXP).to(tl.float32)
        Cv = _conv_silu(xbc_row, hist_row, conv_w_ptr, conv_b_ptr, d_inner + gn + c_B, n_ok, stride_w_d,
                        stride_w_k, WIDTH, HAS_BIAS, FAST_EXP).to(tl.float32)
    else:
        conved_row = conved_ptr + b * stride_conved_b
        xv = tl.load(conved_row + c_x, mask=p_ok, other=0.0).to(tl.float32)
        Bv = tl.load(conved_row + d_inner + c_B, mask=n_ok, other=0.0).to(tl.float32)
        Cv = tl.load(conved_row + d_inner + gn + c_B, mask=n_ok, other=0.0).to(tl.float32)

    dt = tl.load(proj_row + d_inner + conv_dim + h).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + h).to(tl.float32)
    dt = _softplus(dt)  # no clamp at decode (layers/mixer2.py)
    dA = tl.exp(dt * tl.load(A_ptr + h))
    # (dt * B) first, then times x: the reference's order
    state = state * dA + (dt * Bv)[None, :] * xv[:, None]  # [BLOCK_P, BLOCK_N] fp32
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=tile_ok)
    y = tl.sum(state * Cv[None, :], axis=1)  # [BLOCK_P]
    if HAS_D:
        y += xv * tl.load(D_ptr + h).to(tl.float32)

    # the gate and the deferred norm: h = y (rounded as the state update returns it) * silu(z)
    act = g_ptr.dtype.element_ty
    zv = tl.load(proj_row + c_x, mask=p_ok, other=0.0).to(tl.float32)
    hv = y.to(act).to(tl.float32) * (zv / (1.0 + tl.exp(-zv)))  # [BLOCK_P] fp32, 0 where masked
    w = tl.load(norm_w_ptr + c_x, mask=p_ok, other=0.0).to(tl.float32)
    tl.store(g_ptrs, (w * hv.to(act).to(tl.float32)).to(act), mask=p_ok)
    tl.store(sq_out, tl.sum(hv * hv, axis=0))

    if FUSE_CONV:
        _shift_history(xbc_row, hist_row, c_x, p_ok, WIDTH)
        # B and C: shifted once every program of this sequence has read them (module docstring).
        # NOTE: relaxed is enough: the barrier holds every warp until its B/C history loads have
        # returned (their values are in the state stored above), and the last arriver's stores
        # depend on the count it reads
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + b, 1, sem="relaxed")
        if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
            tl.store(arrivals_ptr + b, 0)
            offs_bc = tl.arange(0, BLOCK_BC)
            _shift_history(xbc_row, hist_row, d_inner + offs_bc, offs_bc < 2 * gn, WIDTH)


def mamba2_decode_step_triton(
    proj: Tensor,
    conv_state: Tensor,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    ssm_state: Tensor,
    A: Tensor,
    D: Tensor | None,
    dt_bias: Tensor | None,
    norm_weight: Tensor,
    *,
    state_indices: Tensor,
    ngroups: int,
    arrivals: Tensor | None = None,
) -> GatedSquares:
    """Triton `mamba2_decode_step_ref` (shapes there), plus

      arrivals  [>= B] int32, all zero; left all zero (the B/C election counters, docstring)

    Returns GatedSquares(g [B, d_inner] in proj.dtype, sq [B, H * ceil(P / BLOCK_P)] fp32).
    One launch, no host synchronization (CUDA-graph safe).
    """
    d_inner, conv_dim, H = check_mixer_decode_args(proj, conv_state, conv_weight, ssm_state, norm_weight, ngroups)
    Bt, P, N = proj.shape[0], ssm_state.shape[2], ssm_state.shape[3]
    z_x = proj[:, d_inner:d_inner + conv_dim]  # views, for the shared checks only
    _check_conv_args("mamba2_decode_step", z_x, conv_weight, conv_bias, conv_state, state_indices, Bt, "silu")
    x3 = z_x[:, :d_inner].unflatten(1, (H, P))
    bc = z_x[:, d_inner:].unflatten(1, (2 * ngroups, N))
    check_ssu_args(ssm_state, x3, proj[:, -H:], A, bc[:, :ngroups], bc[:, ngroups:], state_indices, D, dt_bias)
    if arrivals is None:
        raise ValueError("mamba2_decode_step: the Triton kernel needs `arrivals` (CachePool.arrivals)")
    if arrivals.dtype != torch.int32 or arrivals.dim() != 1 or arrivals.shape[0] < Bt:
        raise ValueError(
            f"mamba2_decode_step: arrivals must be int32 [>= {Bt} rows], got {arrivals.dtype} "
            f"{tuple(arrivals.shape)}"
        )

    return launch_decode_step(proj, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias, norm_weight,
                              state_indices, ngroups, arrivals, default_config(Bt, P, N, ssm_state.dtype))


def launch_decode_step(
    proj: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, ssm_state: Tensor, A: Tensor,
    D: Tensor | None, dt_bias: Tensor | None, norm_weight: Tensor, state_indices: Tensor, ngroups: int,
    arrivals: Tensor, cfg: DecodeStepConfig,
) -> GatedSquares:
    """The launch(es) behind `mamba2_decode_step_triton` with the configuration chosen by the caller
    (the benchmark sweeps it); arguments already checked."""
    Bt, H, P, N = proj.shape[0], ssm_state.shape[1], ssm_state.shape[2], ssm_state.shape[3]
    d_inner, conv_dim = H * P, conv_weight.shape[0]
    p_tiles = triton.cdiv(P, cfg.block_p)
    g = torch.empty((Bt, d_inner), dtype=proj.dtype, device=proj.device)  # [B, d_inner]
    sq = torch.empty((Bt, H * p_tiles), dtype=torch.float32, device=proj.device)  # [B, K]
    if Bt == 0:
        return GatedSquares(g, sq)
    conved = proj  # unread when the conv is fused
    if not cfg.fuse_conv:
        conved = launch_conv_update(proj[:, d_inner:d_inner + conv_dim], conv_state, conv_weight, conv_bias,
                                    state_indices, "silu", default_update_tile(Bt))  # [B, conv_dim]
    with _on_device(proj):
        _mixer_decode_kernel[(p_tiles, H, Bt)](
            proj, conved, conv_state, conv_weight, conv_bias, ssm_state, A.contiguous(),
            None if D is None else D.contiguous(), None if dt_bias is None else dt_bias.contiguous(),
            norm_weight.contiguous(), state_indices.contiguous(), arrivals, g, sq,
            P, N, H // ngroups, d_inner, conv_dim, ngroups * N,
            proj.stride(0), conved.stride(0), conv_weight.stride(0), conv_weight.stride(1),
            ssm_state.stride(0), ssm_state.stride(1), g.stride(0), sq.stride(0),
            WIDTH=conv_weight.shape[1], HAS_BIAS=conv_bias is not None, HAS_D=D is not None,
            HAS_DT_BIAS=dt_bias is not None, FUSE_CONV=cfg.fuse_conv, FAST_EXP=proj.is_cuda, BLOCK_P=cfg.block_p,
            BLOCK_N=triton.next_power_of_2(N), BLOCK_BC=triton.next_power_of_2(2 * ngroups * N),
            num_warps=cfg.num_warps,
        )
    return GatedSquares(g, sq)
