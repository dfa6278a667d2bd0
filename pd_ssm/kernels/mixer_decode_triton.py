"""Triton `mamba2_decode_step_ref`: the conv update, then the state update and the gate in one launch.

The second kernel is ssu_triton.py's (same grid: a [BLOCK_P, dstate] tile of one head of one
sequence per program, slot-major; same arithmetic) with the gated norm's work folded in: it reads
z and the norm weight beside x, B, C and dt, and writes g = weight * (y * silu(z)) and the tile's
sum of squares instead of y, so y never goes through memory and the gated norm's launch is gone
(its scale is deferred: kernels/mixer_decode.py). g equals the three-kernel path's to the bit.

At one row the conv runs inside in_proj's GEMV instead (in_proj_conv_triton.py; `xbc` given here).
Why the conv is not folded into this kernel: a single kernel (each program convolving its x channels
and recomputing its group's B and C, the B/C history shifted by the last program of a sequence to
arrive at an atomic counter) measured the same at batch 1 (6.3 against 6.2 us a layer, H200) and
13-15% slower than the conv launch + this kernel at batch 32 and 128 (benchmarks/decode_step_gpu.py,
RESULTS.md session 4): every program reloading B, C and their history costs more than a launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._checks import check_last_dim_contiguous, check_shape
from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.conv1d import _check_conv_args
from pd_ssm.kernels.conv1d_triton_update import default_update_tile, launch_conv_update
from pd_ssm.kernels.launch import FastKernel
from pd_ssm.kernels.mixer_decode import check_mixer_decode_args
from pd_ssm.kernels.pdl import launch_options, pdl_gate, use_pdl
from pd_ssm.kernels.rmsnorm import GatedSquares
from pd_ssm.kernels.ssu import check_ssu_args
from pd_ssm.kernels.ssu_triton import SSUConfig, _softplus
from pd_ssm.kernels.ssu_triton import default_config as ssu_config


@triton.jit
def _gated_ssu_kernel(
    # pointers
    proj_ptr, xbc_ptr, state_ptr, A_ptr, D_ptr, dt_bias_ptr, norm_w_ptr, slot_ptr, g_ptr, sq_ptr,
    # dimensions
    headdim, dstate, heads_per_group, d_inner, conv_dim, gn,
    # strides (the pool is contiguous: [slot, h, p, n])
    stride_proj_b, stride_xbc_b, stride_state_slot, stride_state_head, stride_g_b, stride_sq_b,
    # meta-parameters
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr, ZDT_LATE: tl.constexpr,
):
    """ZDT_LATE: z and dt are read after the PDL gate (the launch before this one wrote them: in_proj
    with the conv fused in, in_proj_conv_triton.py)."""
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P] headdim row
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N] dstate column
    p_ok = offs_p < headdim
    n_ok = offs_n < dstate
    c_x = h * headdim + offs_p  # [BLOCK_P] channel in z, in x and in g
    g_ptrs = g_ptr + b * stride_g_b + c_x
    sq_out = sq_ptr + b * stride_sq_b + h * tl.num_programs(0) + pid_p
    slot = tl.load(slot_ptr + b).to(tl.int64)
    live = slot >= 0  # a negative slot is CUDA-graph padding: touch no state, write zeros
    state_ptrs = (state_ptr + tl.maximum(slot, 0) * stride_state_slot + h * stride_state_head
                  + offs_p[:, None] * dstate + offs_n[None, :])  # [BLOCK_P, BLOCK_N]
    tile_ok = p_ok[:, None] & n_ok[None, :] & live
    # NOTE: issue the big load first and every small one right after, before any arithmetic: a
    # program streams only a few KB, so each load issued late adds its latency to the program's
    # life (the gate's z and weight loaded after y cost ~9 us a layer at batch 32, H200).
    # Before the PDL gate (pdl.py) everything but the conv's output xbc: the state was last written
    # by this layer's previous step, z and dt by in_proj, the launch before the conv's
    state = tl.load(state_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
    proj_row = proj_ptr + b * stride_proj_b
    xbc_row = xbc_ptr + b * stride_xbc_b
    c_B = (h // heads_per_group) * dstate + offs_n  # [BLOCK_N] channel of B in x | B | C, less d_inner
    if not ZDT_LATE:
        dt = tl.load(proj_row + d_inner + conv_dim + h).to(tl.float32)
        zv = tl.load(proj_row + c_x, mask=p_ok, other=0.0).to(tl.float32)
    w = tl.load(norm_w_ptr + c_x, mask=p_ok, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + h)
    if HAS_DT_BIAS:
        dt_b = tl.load(dt_bias_ptr + h).to(tl.float32)
    if HAS_D:
        Dh = tl.load(D_ptr + h).to(tl.float32)
    pdl_gate(PDL)
    if ZDT_LATE:
        dt = tl.load(proj_row + d_inner + conv_dim + h).to(tl.float32)
        zv = tl.load(proj_row + c_x, mask=p_ok, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += dt_b
    if not live:
        tl.store(g_ptrs, tl.zeros([BLOCK_P], dtype=g_ptr.dtype.element_ty), mask=p_ok)
        tl.store(sq_out, 0.0)
        return
    xv = tl.load(xbc_row + c_x, mask=p_ok, other=0.0).to(tl.float32)
    Bv = tl.load(xbc_row + d_inner + c_B, mask=n_ok, other=0.0).to(tl.float32)
    Cv = tl.load(xbc_row + d_inner + gn + c_B, mask=n_ok, other=0.0).to(tl.float32)

    dt = _softplus(dt)  # no clamp at decode (layers/mixer2.py)
    dA = tl.exp(dt * A)
    # (dt * B) first, then times x: the reference's order
    state = state * dA + (dt * Bv)[None, :] * xv[:, None]  # [BLOCK_P, BLOCK_N] fp32
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=tile_ok)
    y = tl.sum(state * Cv[None, :], axis=1)  # [BLOCK_P]
    if HAS_D:
        y += xv * Dh

    # the gate and the deferred norm: h = y (rounded as the state update returns it) * silu(z)
    act = g_ptr.dtype.element_ty
    hv = y.to(act).to(tl.float32) * (zv / (1.0 + tl.exp(-zv)))  # [BLOCK_P] fp32, 0 where masked
    tl.store(g_ptrs, (w * hv.to(act).to(tl.float32)).to(act), mask=p_ok)
    tl.store(sq_out, tl.sum(hv * hv, axis=0))


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
    xbc: Tensor | None = None,
) -> GatedSquares:
    """Triton `mamba2_decode_step_ref` (shapes there): the conv update (unless `xbc`, the conv's
    output, is given), then one launch for the state update, the gate and the squares. Returns
    GatedSquares(g [B, d_inner] in proj.dtype, sq [B, H * ceil(P / BLOCK_P)] fp32). No host
    synchronization (CUDA-graph safe).
    """
    d_inner, conv_dim, H = check_mixer_decode_args(proj, conv_state, conv_weight, ssm_state, norm_weight, ngroups)
    Bt, P, N = proj.shape[0], ssm_state.shape[2], ssm_state.shape[3]
    raw = proj[:, d_inner:d_inner + conv_dim]  # views, for the shared checks
    _check_conv_args("mamba2_decode_step", raw, conv_weight, conv_bias, conv_state, state_indices, Bt, "silu")
    x3 = raw[:, :d_inner].unflatten(1, (H, P))
    bc = raw[:, d_inner:].unflatten(1, (2 * ngroups, N))
    check_ssu_args(ssm_state, x3, proj[:, -H:], A, bc[:, :ngroups], bc[:, ngroups:], state_indices, D, dt_bias)
    if xbc is not None:
        check_shape("mamba2_decode_step", "xbc", xbc, "[B, conv_dim]", (Bt, conv_dim))
        check_last_dim_contiguous("mamba2_decode_step", "xbc", xbc)
    return launch_decode_step(proj, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias, norm_weight,
                              state_indices, ngroups, default_config(Bt, P, N, ssm_state.dtype), xbc)


def default_config(batch: int, headdim: int, dstate: int, state_dtype: torch.dtype) -> SSUConfig:
    """The state update's tile; at one sequence twice the rows (16 KB of fp32 state) and 8 warps a
    program, from 32 sequences on half the rows (4 KB) and one warp. Measured per layer in CUDA
    graphs on an H200, 2.7B shape: at batch 32 / 128 two warps 50.0 / 182.9 us, four 53.4 / 192.0 us,
    the three-kernel path 52.1 / 184.8 us, at batch 1 four warps 6.6 us against the three kernels'
    8.3 us (decode_step_gpu.py, RESULTS.md session 4); in
    the 32-row layer chain (the pending norm's, session 20, wide_out_proj_gpu.py) 8 rows and one warp
    75.9-76.0 against 77.2-77.6 us a layer for 16 rows and two. At one sequence, 32 rows and 8 warps
    (160 programs, 8 state values a thread): the engine's batch-1 step 1.706-1.712 ms against 1.742-1.751
    for 16 rows and 4 warps, 1.715-1.722 for 16 and 8, 1.721-1.727 for 16 and 16, 1.764-1.768 for 32 and
    4, 1.872-1.892 for 8 and 2 (RESULTS.md session 23, four A/B calls)."""
    cfg = ssu_config(headdim, dstate, state_dtype)
    if batch == 1:
        return cfg._replace(block_p=min(pow2(headdim), 2 * cfg.block_p), num_warps=8)
    return cfg if batch < 32 else cfg._replace(block_p=max(1, cfg.block_p // 2), num_warps=1)


_GATED_SSU = FastKernel(_gated_ssu_kernel)


def launch_decode_step(
    proj: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, ssm_state: Tensor, A: Tensor,
    D: Tensor | None, dt_bias: Tensor | None, norm_weight: Tensor, state_indices: Tensor, ngroups: int,
    cfg: SSUConfig, xbc: Tensor | None = None,
) -> GatedSquares:
    """The launches behind `mamba2_decode_step_triton` with the state update's tile chosen by the
    caller (the benchmark sweeps it); arguments already checked."""
    Bt, H, P, N = proj.shape[0], ssm_state.shape[1], ssm_state.shape[2], ssm_state.shape[3]
    d_inner, conv_dim = H * P, conv_weight.shape[0]
    p_tiles = cdiv(P, cfg.block_p)
    g = torch.empty((Bt, d_inner), dtype=proj.dtype, device=proj.device)  # [B, d_inner]
    sq = torch.empty((Bt, H * p_tiles), dtype=torch.float32, device=proj.device)  # [B, K]
    if Bt == 0:
        return GatedSquares(g, sq)
    # NOTE: under PDL the kernel reads z and dt (proj) before its gate only where the conv launch sits
    # between it and in_proj, which wrote proj (pdl.py, contracts 1 and 3); after it otherwise
    zdt_late = xbc is not None
    if xbc is None:
        xbc = launch_conv_update(proj[:, d_inner:d_inner + conv_dim], conv_state, conv_weight, conv_bias,
                                 state_indices, "silu", default_update_tile(Bt))  # [B, conv_dim]: x | B | C
    pdl = use_pdl(proj)
    with on_device(proj):
        _GATED_SSU[(p_tiles, H, Bt)](
            proj, xbc, ssm_state, A.contiguous(),
            None if D is None else D.contiguous(), None if dt_bias is None else dt_bias.contiguous(),
            norm_weight.contiguous(), state_indices.contiguous(), g, sq,
            P, N, H // ngroups, d_inner, conv_dim, ngroups * N,
            proj.stride(0), xbc.stride(0), ssm_state.stride(0), ssm_state.stride(1), g.stride(0), sq.stride(0),
            HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, BLOCK_P=cfg.block_p,
            BLOCK_N=pow2(N), PDL=pdl, ZDT_LATE=zdt_late, num_warps=cfg.num_warps,
            **launch_options(pdl),
        )
    return GatedSquares(g, sq)
