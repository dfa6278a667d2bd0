"""A decode step's block boundary with the next RMSNorm's scale left to the next in_proj.

At batch 1 a Mamba2 block boundary is out_proj (a GEMV), then the residual add and RMSNorm (one
program: a reduction over the whole row), then the next block's in_proj (a GEMV). The norm's
launch is pure latency between two weight streams (2.4-2.6 us a layer in the replayed 2.7B decode
step on an H200, RESULTS.md session 18). It splits cleanly:

  - out_proj's programs each own a few output columns: each adds its columns to the residual
    (applying the gated norm's deferred row scale, RowRms), writes the new residual, writes
    weight * residual for the next norm (rounded to the weight's dtype), and writes its columns'
    share of that norm's sum of squares: `out_proj_add` -> (residual, PendingNorm(x, ss, eps));
  - the norm's row scale r = rsqrt(sum(ss) / d + eps) is one scalar per row, so the next in_proj
    computes r * (W @ x) instead of W @ (weight * (residual * r)): `linear_pending_ref`.

In a decode step of a few rows the boundary is the same with cuBLAS GEMMs: there out_proj becomes
the split-K GEMM of skinny_gemm_triton.py plus one reduce launch doing the epilogue (replacing
cuBLAS's split-K and reduce and the norm's launch), and in_proj that file's DOT tile with the
scale, and the conv update, in its epilogue (out_proj_add_triton.py, PENDING_MAX_ROWS;
in_proj_conv_triton.py).

The reference rounds residual * r to the weight's dtype and then the product with the weight;
here the residual (rounded to the weight's dtype, as the reference rounds it before normalizing)
times the weight is rounded once and r multiplies in_proj's fp32 sums. Two roundings of the
input either way, in another place: close to the reference, not bit-equal to it. The new
residual is the reference's add to the bit (up to out_proj's own sum order).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from pd_ssm.kernels._checks import FLOAT_DTYPES, check_dtype, check_ndim, check_shape
from pd_ssm.kernels.l2_prefetch import L2Rows, check_hint
from pd_ssm.kernels.linear import linear_ref
from pd_ssm.kernels.rmsnorm import RowRms


class PendingNorm(NamedTuple):
    """weight * RMSNorm(residual) with the norm's per-row scale still to apply (module docstring)."""

    x: Tensor  # [T, d] weight * residual.to(weight dtype), rounded to the weight's dtype
    ss: Tensor  # [T, K] fp32; row t sums to sum(residual[t].to(weight dtype).float() ** 2)
    eps: float

    def scale(self) -> Tensor:
        """r [T] fp32 = rsqrt(mean of squares + eps)."""
        return torch.rsqrt(self.ss.sum(-1) / self.x.shape[1] + self.eps)


def check_pending_norm(k: str, p: PendingNorm) -> None:
    check_ndim(k, "pending.x", p.x, "[T, d]")
    check_shape(k, "pending.ss", p.ss, "[T, K]", (p.x.shape[0], p.ss.shape[-1]))
    check_dtype(k, "pending.ss", p.ss, (torch.float32,))
    check_dtype(k, "pending.x", p.x, FLOAT_DTYPES)


def pending_norm_ref(g: Tensor, weight: Tensor) -> bool:
    """Whether a block boundary on out_proj's (g, weight) takes `out_proj_add` and leaves the next norm
    pending: never with the reference kernels. The pending norm rounds in other places than
    transformers' modules do, and the torch backend's engine must give transformers' tokens."""
    return False


def out_proj_add_ref(
    g: Tensor, weight: Tensor, x_rms: RowRms, residual: Tensor, norm_weight: Tensor, eps: float, *,
    residual_dtype: torch.dtype, prefetch: L2Rows | None = None,
) -> tuple[Tensor, PendingNorm]:
    """out_proj, then the residual add of `add_rms_norm_ref(out, residual, x_rms=...)`, and the next
    RMSNorm (norm_weight, eps) left pending. `prefetch` (what the next kernel reads first) is a hint
    for the GPU kernel's timing (l2_prefetch.py): checked, without effect here.

      g            [T, d_inner]   out_proj's input (the gated value, its row scale deferred)
      weight       [d, d_inner]   out_proj (no bias: the row scale would have to skip it)
      x_rms        RowRms         the gated norm's deferred scale, applied to out_proj's output in fp32
      residual     [T, d]         the residual stream before the add, any float dtype
      norm_weight  [d]            the next norm's weight; its dtype is the norm's

    Returns (residual [T, d] in residual_dtype, PendingNorm(x [T, d], ss [T, 1], eps)).
    """
    if prefetch is not None:
        check_hint("out_proj_add", prefetch)
    out = linear_ref(g, weight)  # [T, d] in g.dtype
    new = (residual.to(residual_dtype) + out.float() * x_rms.scale()[:, None]).to(residual_dtype)
    h = new.to(norm_weight.dtype)  # the norm's input, as the reference rounds it
    return new, PendingNorm(norm_weight * h, h.float().pow(2).sum(-1, keepdim=True), eps)


def linear_pending_ref(p: PendingNorm, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y [T, N] = r * (W @ x) (+ bias) in fp32, rounded once to W's dtype: the layer after a pending
    norm, its scale r applied to the sums (module docstring)."""
    y = torch.nn.functional.linear(p.x.float(), weight.float()) * p.scale()[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(weight.dtype)
