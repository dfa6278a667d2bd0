"""RMSNorm and the Mamba2 gated, grouped RMSNorm.

The casts follow the HF modules exactly, because in bf16 their order changes the result:
normalize in fp32, cast the normalized value back to the input dtype, then multiply by the weight
in the input dtype (Mamba2RMSNorm, BambaRMSNorm, MambaRMSNormGated and the Bamba / NemotronH
gated norms). NemotronHRMSNorm instead multiplies by the weight in fp32 and casts the product
once: `rms_norm_ref(..., weight_in_fp32=True)`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from pd_ssm.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    check_shape,
)


def _check_norm_args(k: str, x: Tensor, weight: Tensor) -> None:
    check_ndim(k, "x", x, "[T, d]")
    check_shape(k, "weight", weight, "[d]", (x.shape[1],))
    check_dtype(k, "x", x, FLOAT_DTYPES)
    # NOTE: the HF modules return weight * x, whose dtype would follow an fp32 weight; one dtype
    # for both keeps the output in x.dtype
    check_dtype(k, "weight", weight, (x.dtype,))
    check_last_dim_contiguous(k, "x", x)


def _check_gated_norm_args(x: Tensor, gate: Tensor, weight: Tensor, group_size: int) -> None:
    """The checks of rms_norm_gated, shared by the reference and the Triton launcher."""
    k = "rms_norm_gated"
    _check_norm_args(k, x, weight)
    check_shape(k, "gate", gate, "[T, d]", tuple(x.shape))
    check_dtype(k, "gate", gate, FLOAT_DTYPES)
    check_last_dim_contiguous(k, "gate", gate)
    check_same_device(k, x=x, gate=gate, weight=weight)
    d = x.shape[1]
    if group_size <= 0 or d % group_size != 0:
        raise ValueError(f"{k}: d ({d}) must be a multiple of group_size ({group_size})")


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float, *, weight_in_fp32: bool = False) -> Tensor:
    """y = weight * x / sqrt(mean(x^2) + eps) over the last axis.

    Shapes: x [T, d] fp32/bf16/fp16 (stride 1 on the last axis); weight [d] in x.dtype.
    Returns y [T, d] in x.dtype. weight_in_fp32 selects NemotronH's order of casts.
    """
    _check_norm_args("rms_norm", x, weight)
    check_same_device("rms_norm", x=x, weight=weight)
    h = x.float()  # [T, d]
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)  # [T, d] fp32
    if weight_in_fp32:
        return (weight.float() * h).to(x.dtype)
    return weight * h.to(x.dtype)


class RowRms(NamedTuple):
    """A per-row RMS scale still to be applied: rsqrt(sq.sum(-1) / width + eps).

    The gated norm of an ungrouped Mamba2 mixer (group_size == d_inner) scales every feature of a
    row by the same r, so r commutes with out_proj; the mixer hands out_proj the unscaled value
    and this, and the next block's `add_rms_norm(x_rms=...)` applies r during the residual add
    (one launch per layer fewer: kernels/mixer_decode.py).
    """

    sq: Tensor  # [T, K] fp32 partial sums of squares; row t sums to the row's sum of squares
    width: int  # features the mean runs over (d_inner)
    eps: float

    def scale(self) -> Tensor:
        """r [T] fp32, in the reference's arithmetic."""
        return torch.rsqrt(self.sq.sum(-1) / self.width + self.eps)


class GatedSquares(NamedTuple):
    """The gated norm with its scale deferred (RowRms): what out_proj and the next norm need."""

    g: Tensor  # [T, d] weight * (x * silu(gate)) in x.dtype, the gated value rounded first
    sq: Tensor  # [T, K] fp32, rows summing to sum((x * silu(gate))^2) in fp32


class AddNormOutput(NamedTuple):
    normed: Tensor  # [T, d] in weight.dtype: the input of the next mixer (or of the LM head)
    residual: Tensor  # [T, d] in residual_dtype: the running residual stream after the add


def _check_add_norm_args(k: str, x: Tensor | None, residual: Tensor, weight: Tensor,
                         residual_dtype: torch.dtype) -> None:
    check_ndim(k, "residual", residual, "[T, d]")
    check_shape(k, "weight", weight, "[d]", (residual.shape[1],))
    check_dtype(k, "residual", residual, FLOAT_DTYPES)
    check_dtype(k, "weight", weight, FLOAT_DTYPES)
    check_last_dim_contiguous(k, "residual", residual)
    if residual_dtype not in FLOAT_DTYPES:
        raise TypeError(f"{k}: residual_dtype must be one of {FLOAT_DTYPES}, got {residual_dtype}")
    if x is not None:
        check_shape(k, "x", x, "[T, d]", tuple(residual.shape))
        check_dtype(k, "x", x, FLOAT_DTYPES)
        check_last_dim_contiguous(k, "x", x)
        check_same_device(k, x=x, residual=residual, weight=weight)
    else:
        check_same_device(k, residual=residual, weight=weight)


def _check_x_rms(k: str, x: Tensor | None, residual: Tensor, x_rms: RowRms | None) -> None:
    if x_rms is None:
        return
    if x is None:
        raise ValueError(f"{k}: x_rms scales x, but x is None")
    check_ndim(k, "x_rms.sq", x_rms.sq, "[T, K]")
    check_shape(k, "x_rms.sq", x_rms.sq, "[T, K]", (residual.shape[0], x_rms.sq.shape[1]))
    check_dtype(k, "x_rms.sq", x_rms.sq, (torch.float32,))
    check_last_dim_contiguous(k, "x_rms.sq", x_rms.sq)
    check_same_device(k, x=x, sq=x_rms.sq)
    if x_rms.width <= 0:
        raise ValueError(f"{k}: x_rms.width must be positive, got {x_rms.width}")


def add_rms_norm_ref(x: Tensor | None, residual: Tensor, weight: Tensor, eps: float, *,
                     residual_dtype: torch.dtype, weight_in_fp32: bool = False,
                     x_rms: RowRms | None = None) -> AddNormOutput:
    """The pre-norm step of a block: new_residual = residual + x, normed = rms_norm(new_residual).

    Shapes: x [T, d] (the previous block's output; None before the first block) and residual
    [T, d], fp32/bf16/fp16 with stride 1 on the last axis; weight [d]. residual is upcast to
    residual_dtype before the add (torch's `residual.float() + x`: x upcast, one add, one rounding
    to residual_dtype); the norm then sees `new_residual.to(weight.dtype)` exactly as `rms_norm_ref`.
    x_rms: x is first multiplied, in fp32, by the row scale x_rms.scale() (a deferred gated norm).
    Returns (normed [T, d] in weight.dtype, new_residual [T, d] in residual_dtype).
    """
    _check_add_norm_args("add_rms_norm", x, residual, weight, residual_dtype)
    _check_x_rms("add_rms_norm", x, residual, x_rms)
    new_residual = residual.to(residual_dtype)  # [T, d]
    if x is not None and x_rms is not None:
        new_residual = (new_residual + x.float() * x_rms.scale()[:, None]).to(residual_dtype)
    elif x is not None:
        new_residual = (new_residual + x).to(residual_dtype)
    normed = rms_norm_ref(new_residual.to(weight.dtype), weight, eps, weight_in_fp32=weight_in_fp32)
    return AddNormOutput(normed, new_residual)


def rms_norm_gated_ref(x: Tensor, gate: Tensor, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """y = weight * norm_g(x * silu(gate)), normalized over each group of group_size features.

    Shapes: x, gate [T, d] (fp32/bf16/fp16, stride 1 on the last axis; gate may differ in dtype);
    weight [d] in x.dtype; d % group_size == 0 (group_size = d gives one plain RMSNorm over d).
    The gate multiplies before the norm (HF's MambaRMSNormGated, mamba_ssm's norm_before_gate=False).
    Returns y [T, d] in x.dtype.
    """
    _check_gated_norm_args(x, gate, weight, group_size)
    T, d = x.shape
    h = x.float() * F.silu(gate.float())  # [T, d] fp32
    h = h.view(T, d // group_size, group_size)  # [T, groups, group_size]
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.view(T, d).to(x.dtype)


def rms_norm_gated_squares_ref(x: Tensor, gate: Tensor, weight: Tensor) -> GatedSquares:
    """`rms_norm_gated_ref` over whole rows with the scale left out (RowRms applies it later).

    Shapes: x, gate [T, d] (fp32/bf16/fp16, stride 1 on the last axis); weight [d] in x.dtype.
    Returns g = weight * (x * silu(gate)).to(x.dtype) [T, d] in x.dtype and sq [T, 1] fp32, the
    row sums of (x * silu(gate))^2 in fp32.
    """
    _check_gated_norm_args(x, gate, weight, x.shape[1])
    h = x.float() * F.silu(gate.float())  # [T, d] fp32
    return GatedSquares(weight * h.to(x.dtype), h.pow(2).sum(-1, keepdim=True))
