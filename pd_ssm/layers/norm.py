"""RMSNorm and the gated, grouped RMSNorm of the Mamba2 mixer, as modules over the kernels.

Both keep the HF parameter name `weight` so checkpoints load by name.  The arithmetic (fp32
statistics, where the weight multiply happens) is the kernels' business; these modules only hold
the parameters and the shape facts (eps, group size).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from pd_ssm.kernels.dispatch import Kernels
from pd_ssm.kernels.pending_norm import PendingNorm
from pd_ssm.kernels.rmsnorm import AddNormOutput, RowRms


class ScaledDelta(NamedTuple):
    """A block's output still to be scaled per row: out * rms.scale()[:, None] (a gated norm whose
    scale was deferred past out_proj, layers/mixer2.py). The next `add_forward` applies it."""

    out: torch.Tensor  # [T, hidden]
    rms: RowRms


class PendingBlock(NamedTuple):
    """A block's output with the block boundary finished by its mixer (out_proj's epilogue did the
    residual add and the next norm's statistics, kernels/pending_norm.py): the residual stream after
    the add, and the next block's norm input with its scale still to apply."""

    residual: torch.Tensor  # [T, hidden] in the residual dtype
    pending: PendingNorm


class RMSNorm(nn.Module):
    """y = weight * x / rms(x).  `weight_in_fp32`: NemotronH's order (multiply in fp32, cast once)
    instead of Mamba2/Bamba's (cast the normalized x to x.dtype, then multiply)."""

    def __init__(self, hidden_size: int, eps: float, kernels: Kernels, *, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden] in x.dtype
        # NOTE: an fp32 x (Mamba2's fp32 residual stream reaching norm_f) with a bf16 weight: HF's
        # `weight * x_normed` promotes to fp32, which is what an upcast weight computes, exactly
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        if self.weight_in_fp32:
            return self.kernels.rms_norm(x, w, self.eps, weight_in_fp32=True)
        return self.kernels.rms_norm(x, w, self.eps)

    def add_forward(
        self, delta: torch.Tensor | ScaledDelta | None, residual: torch.Tensor, residual_dtype: torch.dtype,
        *, out_dtype: torch.dtype | None = None,
    ) -> AddNormOutput:
        """(norm(residual + delta), residual + delta) in one kernel; delta is None before the first block.
        A ScaledDelta is scaled per row (fp32) before the add.

        The residual is upcast to residual_dtype before the add; the norm runs on the new residual
        rounded to out_dtype (default the weight's dtype), and its output is in out_dtype.
        """
        w = self.weight if out_dtype in (None, self.weight.dtype) else self.weight.to(out_dtype)
        if isinstance(delta, ScaledDelta):
            return self.kernels.add_rms_norm(
                delta.out, residual, w, self.eps, residual_dtype=residual_dtype,
                weight_in_fp32=self.weight_in_fp32, x_rms=delta.rms,
            )
        return self.kernels.add_rms_norm(
            delta, residual, w, self.eps, residual_dtype=residual_dtype, weight_in_fp32=self.weight_in_fp32
        )

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, weight_in_fp32={self.weight_in_fp32}"


class NormBoundary(NamedTuple):
    """What a mixer needs to finish its block's boundary itself (PendingBlock)."""

    residual: torch.Tensor  # [T, hidden] the residual stream the block's output is added to
    residual_dtype: torch.dtype
    next_norm: RMSNorm  # the next block's pre-norm
    # the weight the next block streams first (its in_proj's [N, hidden]): the boundary's last kernel
    # asks L2 for its head (kernels/l2_prefetch.py); None: nothing to ask for
    next_weight: torch.Tensor | None = None


class GatedRMSNorm(nn.Module):
    """y = weight * rmsnorm_per_group(x * silu(gate)): the norm between the SSM and out_proj.

    `group_size` = d_inner / n_groups for every architecture transformers >= 5 ships (Mamba2,
    Bamba, NemotronH); group_size == hidden_size normalizes over the whole row.
    """

    def __init__(self, hidden_size: int, eps: float, group_size: int, kernels: Kernels) -> None:
        super().__init__()
        if hidden_size % group_size != 0:
            raise ValueError(f"gated norm: group_size {group_size} does not divide {hidden_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.group_size = group_size
        self.kernels = kernels

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [T, d] x2 -> [T, d]
        return self.kernels.rms_norm_gated(x, gate, self.weight, self.eps, self.group_size)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, group_size={self.group_size}"
