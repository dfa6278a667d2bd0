"""Triton RMSNorm and the Mamba2 gated, grouped RMSNorm: one kernel, one program per (row, group).

Same signatures and cast order as `rmsnorm.rms_norm_ref` / `rms_norm_gated_ref`: the sum of squares,
the reciprocal root (correctly rounded sqrt, then a division, like torch on the CPU) and the
normalization run in fp32; then either (default) the normalized value is rounded to x.dtype and
multiplied by the weight in x.dtype (a product of two x.dtype values, rounded once), or
(weight_in_fp32, NemotronH) the weight multiplies in fp32 and the product is rounded once.

`add_rms_norm_triton` fuses the residual add of a pre-norm block in front of the norm (one program
per row): the add runs in fp32 and is rounded to the residual's dtype, which is then rounded to the
weight's dtype before the statistics, as `rmsnorm.add_rms_norm_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._checks import (
    check_same_device,
)
from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.launch import FastKernel
from pd_ssm.kernels.pdl import launch_options, pdl_gate, use_pdl
from pd_ssm.kernels.rmsnorm import (
    AddNormOutput,
    GatedSquares,
    RowRms,
    _check_add_norm_args,
    _check_gated_norm_args,
    _check_norm_args,
    _check_x_rms,
)

# NOTE: a group up to this many features is held in registers (one read of x); longer groups take
# two passes over x, the second mostly from L2
MAX_BLOCK = 8192


@triton.jit
def _load_h(x_row, g_row, offs, ok, GATED: tl.constexpr):
    """x (times silu(gate), all in fp32) at offs; zero where masked."""
    h = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
    if GATED:
        g = tl.load(g_row + offs, mask=ok, other=0.0).to(tl.float32)
        h = h * (g / (1.0 + tl.exp(-g)))
    return h


@triton.jit
def _scale_store(h, r, w_ptr, out_row, offs, ok, WEIGHT_FP32: tl.constexpr):
    out_dtype = out_row.dtype.element_ty
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if WEIGHT_FP32:
        y = w * (h * r)
    else:
        y = w * (h * r).to(out_dtype).to(tl.float32)  # exact product of two x.dtype values
    tl.store(out_row + offs, y.to(out_dtype), mask=ok)


@triton.jit
def _rms_norm_kernel(
    # pointers
    x_ptr, gate_ptr, w_ptr, out_ptr, sq_ptr,
    # dimensions
    group_size, eps,
    # strides
    stride_x_t, stride_g_t, stride_out_t,
    # meta-parameters
    GATED: tl.constexpr, WEIGHT_FP32: tl.constexpr, DEFER: tl.constexpr, BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr, PDL: tl.constexpr,
):
    # DEFER (one group per row): store the sum of squares to sq[row] and leave the scale out (r = 1)
    pdl_gate(PDL)  # nothing worth loading before it: x is the previous launch's output (pdl.py)
    row = tl.program_id(0).to(tl.int64)
    base = tl.program_id(1) * group_size  # first feature of this group
    x_row = x_ptr + row * stride_x_t + base
    g_row = gate_ptr + row * stride_g_t + base
    out_row = out_ptr + row * stride_out_t + base
    w_grp = w_ptr + base
    offs = tl.arange(0, BLOCK)
    if NUM_CHUNKS == 1:
        ok = offs < group_size
        h = _load_h(x_row, g_row, offs, ok, GATED)
        ss = tl.sum(h * h, axis=0)
        if DEFER:
            tl.store(sq_ptr + row, ss)
            r = 1.0
        else:
            r = 1.0 / tl.sqrt_rn(ss / group_size + eps)
        _scale_store(h, r, w_grp, out_row, offs, ok, WEIGHT_FP32)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            ok = c * BLOCK + offs < group_size
            h = _load_h(x_row, g_row, c * BLOCK + offs, ok, GATED)
            acc += h * h
        ss = tl.sum(acc, axis=0)
        if DEFER:
            tl.store(sq_ptr + row, ss)
            r = 1.0
        else:
            r = 1.0 / tl.sqrt_rn(ss / group_size + eps)
        for c in range(NUM_CHUNKS):
            ok = c * BLOCK + offs < group_size
            h = _load_h(x_row, g_row, c * BLOCK + offs, ok, GATED)
            _scale_store(h, r, w_grp, out_row, c * BLOCK + offs, ok, WEIGHT_FP32)


_RMS_NORM = FastKernel(_rms_norm_kernel)


def _launch(x: Tensor, gate: Tensor | None, weight: Tensor, eps: float, group_size: int,
            weight_in_fp32: bool, sq: Tensor | None = None) -> Tensor:
    """sq [T] fp32 given: the deferred form (one group per row, sums of squares to sq, no scale)."""
    T, d = x.shape
    out = torch.empty((T, d), dtype=x.dtype, device=x.device)  # [T, d]
    if T == 0:
        return out
    block = min(pow2(group_size), MAX_BLOCK)
    pdl = use_pdl(x)
    with on_device(x):
        _RMS_NORM[(T, d // group_size)](
            # NOTE: x stands in for no gate and out for no sq, unread / unwritten
            x, x if gate is None else gate, weight.contiguous(), out, out if sq is None else sq,
            group_size, float(eps),
            x.stride(0), x.stride(0) if gate is None else gate.stride(0), out.stride(0),
            GATED=gate is not None, WEIGHT_FP32=weight_in_fp32, DEFER=sq is not None, BLOCK=block,
            NUM_CHUNKS=cdiv(group_size, block), PDL=pdl, num_warps=min(16, max(1, block // 512)),
            **launch_options(pdl),
        )
    return out


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float, *, weight_in_fp32: bool = False) -> Tensor:
    """Triton `rms_norm_ref`: y = weight * x / sqrt(mean(x^2) + eps) over the last axis.

    Shapes: x [T, d] fp32/bf16/fp16 (stride 1 on the last axis); weight [d] in x.dtype.
    Returns y [T, d] in x.dtype. weight_in_fp32 selects NemotronH's order of casts. No host sync.
    """
    _check_norm_args("rms_norm", x, weight)
    check_same_device("rms_norm", x=x, weight=weight)
    return _launch(x, None, weight, eps, x.shape[1], weight_in_fp32)


def rms_norm_gated_triton(x: Tensor, gate: Tensor, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """Triton `rms_norm_gated_ref`: y = weight * norm_g(x * silu(gate)) over groups of group_size.

    Shapes: x, gate [T, d] (fp32/bf16/fp16, stride 1 on the last axis; gate may differ in dtype);
    weight [d] in x.dtype; d % group_size == 0. Returns y [T, d] in x.dtype. No host sync.
    """
    _check_gated_norm_args(x, gate, weight, group_size)
    return _launch(x, gate, weight, eps, group_size, False)


def rms_norm_gated_squares_triton(x: Tensor, gate: Tensor, weight: Tensor) -> GatedSquares:
    """Triton `rms_norm_gated_squares_ref`: the gated norm over whole rows, scale deferred.

    Shapes: x, gate [T, d] (stride 1 on the last axis); weight [d] in x.dtype. Returns g [T, d] in
    x.dtype and sq [T, 1] fp32 (row sums of squares). One launch, no host sync.
    """
    _check_gated_norm_args(x, gate, weight, x.shape[1])
    sq = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)  # [T, 1]
    return GatedSquares(_launch(x, gate, weight, 0.0, x.shape[1], False, sq), sq)


@triton.jit
def _row_scale(sq_ptr, row, stride_sq_t, num_sq, width, eps, HAS_X_RMS: tl.constexpr, BLOCK_SQ: tl.constexpr):
    """rsqrt(sum(sq[row, :num_sq]) / width + eps) in fp32 (RowRms.scale); 1 without x_rms."""
    if HAS_X_RMS:
        offs = tl.arange(0, BLOCK_SQ)
        ss = tl.sum(tl.load(sq_ptr + row * stride_sq_t + offs, mask=offs < num_sq, other=0.0), axis=0)
        return 1.0 / tl.sqrt_rn(ss / width + eps)
    else:
        return 1.0


@triton.jit
def _add_h(x_row, res_row, res_out_row, offs, ok, x_scale, HAS_X: tl.constexpr, HAS_X_RMS: tl.constexpr,
           STORE_RES: tl.constexpr, NORM_DTYPE: tl.constexpr):
    """new_residual at offs (stored when STORE_RES), returned rounded to NORM_DTYPE, in fp32."""
    r = tl.load(res_row + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_X:
        xv = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_X_RMS:
            xv = xv * x_scale
        r = r + xv
    r = r.to(res_out_row.dtype.element_ty)
    if STORE_RES:
        tl.store(res_out_row + offs, r, mask=ok)
    return r.to(NORM_DTYPE).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(
    # pointers
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, sq_ptr,
    # dimensions
    d, eps, num_sq, sq_width, sq_eps,
    # strides
    stride_x_t, stride_res_t, stride_out_t, stride_res_out_t, stride_sq_t,
    # meta-parameters
    HAS_X: tl.constexpr, HAS_X_RMS: tl.constexpr, WEIGHT_FP32: tl.constexpr, BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr, BLOCK_SQ: tl.constexpr, PDL: tl.constexpr,
):
    # NOTE: the PDL gate comes before any load: the residual may be the previous launch's output
    # too (the embedding's, before the first block), and a row is little to load early
    pdl_gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x_t
    res_row = res_ptr + row * stride_res_t
    out_row = out_ptr + row * stride_out_t
    res_out_row = res_out_ptr + row * stride_res_out_t
    norm_dtype = out_row.dtype.element_ty
    x_scale = _row_scale(sq_ptr, row, stride_sq_t, num_sq, sq_width, sq_eps, HAS_X_RMS, BLOCK_SQ)
    offs = tl.arange(0, BLOCK)
    if NUM_CHUNKS == 1:
        ok = offs < d
        h = _add_h(x_row, res_row, res_out_row, offs, ok, x_scale, HAS_X, HAS_X_RMS, True, norm_dtype)
        r = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) / d + eps)
        _scale_store(h, r, w_ptr, out_row, offs, ok, WEIGHT_FP32)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            ok = c * BLOCK + offs < d
            h = _add_h(x_row, res_row, res_out_row, c * BLOCK + offs, ok, x_scale, HAS_X, HAS_X_RMS, True,
                       norm_dtype)
            acc += h * h
        r = 1.0 / tl.sqrt_rn(tl.sum(acc, axis=0) / d + eps)
        for c in range(NUM_CHUNKS):
            ok = c * BLOCK + offs < d
            # NOTE: recomputed from the inputs (not re-read from res_out): no barrier needed
            h = _add_h(x_row, res_row, res_out_row, c * BLOCK + offs, ok, x_scale, HAS_X, HAS_X_RMS, False,
                       norm_dtype)
            _scale_store(h, r, w_ptr, out_row, c * BLOCK + offs, ok, WEIGHT_FP32)


_ADD_RMS_NORM = FastKernel(_add_rms_norm_kernel)


def add_rms_norm_triton(x: Tensor | None, residual: Tensor, weight: Tensor, eps: float, *,
                        residual_dtype: torch.dtype, weight_in_fp32: bool = False,
                        x_rms: RowRms | None = None) -> AddNormOutput:
    """Triton `add_rms_norm_ref`: new_residual = residual + x, normed = rms_norm(new_residual).

    Shapes: x [T, d] (None before the first block) and residual [T, d], fp32/bf16/fp16 with stride
    1 on the last axis; weight [d]; x_rms.sq [T, K] fp32 (x scaled by x_rms.scale() first).
    Returns (normed [T, d] in weight.dtype, new_residual [T, d] in residual_dtype), both freshly
    allocated. One launch, no host sync.
    """
    _check_add_norm_args("add_rms_norm", x, residual, weight, residual_dtype)
    _check_x_rms("add_rms_norm", x, residual, x_rms)
    T, d = residual.shape
    out = torch.empty((T, d), dtype=weight.dtype, device=residual.device)  # [T, d]
    res_out = torch.empty((T, d), dtype=residual_dtype, device=residual.device)  # [T, d]
    if T == 0:
        return AddNormOutput(out, res_out)
    block = min(pow2(d), MAX_BLOCK)
    pdl = use_pdl(residual)
    num_warps = min(16, max(1, block // 512))
    with on_device(residual):
        _ADD_RMS_NORM[(T,)](
            # NOTE: no x (no x_rms): residual (out) stands in, unread
            residual if x is None else x, residual, weight.contiguous(), out, res_out,
            out if x_rms is None else x_rms.sq,
            d, float(eps), 1 if x_rms is None else x_rms.sq.shape[1],
            1 if x_rms is None else x_rms.width, 0.0 if x_rms is None else float(x_rms.eps),
            residual.stride(0) if x is None else x.stride(0), residual.stride(0), out.stride(0),
            res_out.stride(0), 0 if x_rms is None else x_rms.sq.stride(0),
            HAS_X=x is not None, HAS_X_RMS=x_rms is not None, WEIGHT_FP32=weight_in_fp32, BLOCK=block,
            NUM_CHUNKS=cdiv(d, block),
            BLOCK_SQ=1 if x_rms is None else pow2(x_rms.sq.shape[1]),
            PDL=pdl, num_warps=num_warps, **launch_options(pdl),
        )
    return AddNormOutput(out, res_out)
