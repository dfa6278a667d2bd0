"""The Mamba2 mixer's decode step between its two projections, with the gated norm's scale deferred.

For B sequences of one new token each:

    proj [B, d_inner + conv_dim + H] = z | xBC | dt                  (in_proj's output, HF split order)
    xBC -> causal_conv1d_update (conv state slot per sequence) -> x | B | C
    y   = selective_state_update(x, dt, B, C)                        [B, H, P] in the activation dtype
    h   = y * silu(z) in fp32                                        the gated norm's input
    g   = norm_weight * h.to(dtype)                                  [B, d_inner]
    sq  = partial sums of h^2                                        [B, K] fp32; each row sums to sum(h^2)

An ungrouped gated norm (group_size == d_inner: HF Mamba2 with one group, the 2.7B shape) scales
a whole row by one r = rsqrt(sum(h^2) / d_inner + eps), and out_proj is linear, so
out_proj(weight * h * r) = r * out_proj(weight * h): the mixer hands out_proj g and the next
block's `add_rms_norm(x_rms=RowRms(sq, d_inner, eps))` applies r in its residual add. The Triton
version does the state update and the gate in one program, so y never goes through memory and
the gated norm's launch is gone (two launches per layer and step instead of three). K is the
kernel's choice (the Triton kernel writes one partial per program); only the row sums are defined.

Conv and state update follow `causal_conv1d_update_ref` and `selective_state_update_ref` exactly
(same casts, no dt clamp at decode: layers/mixer2.py); the gated value h is
`rms_norm_gated_squares_ref`'s.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pd_ssm.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_shape,
)
from pd_ssm.kernels.conv1d import causal_conv1d_update_ref
from pd_ssm.kernels.l2_prefetch import L2Rows, check_hint
from pd_ssm.kernels.linear import linear_ref
from pd_ssm.kernels.pending_norm import PendingNorm, linear_pending_ref
from pd_ssm.kernels.rmsnorm import GatedSquares, rms_norm_gated_squares_ref
from pd_ssm.kernels.ssu import selective_state_update_ref


def check_mixer_decode_args(
    proj: Tensor, conv_state: Tensor, conv_weight: Tensor, ssm_state: Tensor, norm_weight: Tensor,
    ngroups: int,
) -> tuple[int, int, int]:
    """The checks this kernel adds to those of the conv update and the state update (which both
    paths run on their slices); returns (d_inner, conv_dim, nheads)."""
    k = "mamba2_decode_step"
    check_ndim(k, "proj", proj, "[B, d_inner + conv_dim + nheads]")
    check_ndim(k, "ssm_state", ssm_state, "[num_slots, nheads, headdim, dstate]")
    check_ndim(k, "conv_weight", conv_weight, "[conv_dim, width]")
    check_ndim(k, "norm_weight", norm_weight, "[d_inner]")
    _, H, P, N = ssm_state.shape
    d_inner, conv_dim = H * P, conv_weight.shape[0]
    if ngroups <= 0 or H % ngroups != 0 or conv_dim != d_inner + 2 * ngroups * N:
        raise ValueError(
            f"{k}: conv_dim ({conv_dim}) must be d_inner ({d_inner}) + 2 * ngroups ({ngroups}) * dstate "
            f"({N}), and nheads ({H}) a multiple of ngroups"
        )
    check_shape(k, "proj", proj, "[B, d_inner + conv_dim + nheads]", (proj.shape[0], d_inner + conv_dim + H))
    check_shape(k, "norm_weight", norm_weight, "[d_inner]", (d_inner,))
    check_dtype(k, "proj", proj, FLOAT_DTYPES)
    check_dtype(k, "norm_weight", norm_weight, (proj.dtype,))
    check_last_dim_contiguous(k, "proj", proj)
    if conv_state.dim() != 3 or conv_state.shape[0] != ssm_state.shape[0]:
        raise ValueError(
            f"{k}: conv_state [num_slots, conv_dim, width-1] and ssm_state must have the same number "
            f"of slots, got {tuple(conv_state.shape)} and {tuple(ssm_state.shape)}"
        )
    return d_inner, conv_dim, H


def mamba2_decode_step_ref(
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
    """One decode token per sequence, from in_proj's output to out_proj's input (module docstring).
    `xbc` [B, conv_dim]: the conv's output where the caller ran the conv already (`in_proj_conv`,
    conv state updated): the conv is skipped.

    Shapes (H = nheads, P = headdim, N = dstate, G = ngroups, d_inner = H * P):
      proj           [B, d_inner + conv_dim + H]   z | x B C | dt, stride 1 on the last axis
      conv_state     [num_slots, conv_dim, width-1] pool, conv_dim = d_inner + 2 * G * N
      conv_weight    [conv_dim, width], conv_bias [conv_dim] or None   dtype of proj
      ssm_state      [num_slots, H, P, N]          pool (fp32, bf16 or fp16)
      A              [H] fp32 (-exp(A_log)); D, dt_bias [H] or None
      norm_weight    [d_inner]                     the gated norm's weight, dtype of proj
      state_indices  [B] int32                     pool slots; distinct; negative = CUDA-graph padding
                                                   (no state touched, g = 0, sq = 0)

    In place on both pools' slots. Returns GatedSquares(g [B, d_inner] in proj.dtype, sq [B, K] fp32).
    """
    d_inner, conv_dim, H = check_mixer_decode_args(proj, conv_state, conv_weight, ssm_state, norm_weight, ngroups)
    Bt, P, N = proj.shape[0], ssm_state.shape[2], ssm_state.shape[3]
    live = state_indices >= 0  # [B]
    # NOTE: no host sync (no nonzero): the reference runs inside CUDA graphs on kernel_backend='torch'.
    # Every row runs on a gathered copy of its slot's states (padding rows on slot 0's); then each
    # row writes back, and a padding row writes what the first live row writes, to the same slot
    # (one value per slot, whatever order the writes land in), or, with no live row, slot 0's own
    # state: nothing changes but the live rows' slots
    rows = torch.arange(Bt, dtype=torch.int32, device=proj.device)  # [B]
    slots = torch.where(live, state_indices, 0).long()  # [B]
    conv_rows, ssm_rows = conv_state[slots], ssm_state[slots]  # [B, conv_dim, width-1], [B, H, P, N]
    z, raw, dt = proj.split([d_inner, conv_dim, H], dim=-1)
    ran_conv = xbc is None  # else the caller's conv updated the conv states already
    if xbc is None:
        xbc = causal_conv1d_update_ref(raw, conv_rows, conv_weight, conv_bias, state_indices=rows)
    x, B, C = xbc.split([d_inner, ngroups * N, ngroups * N], dim=-1)
    y = selective_state_update_ref(
        ssm_rows, x.reshape(Bt, H, P), dt, A, B.reshape(Bt, ngroups, N), C.reshape(Bt, ngroups, N),
        state_indices=rows, D=D, dt_bias=dt_bias, dt_softplus=True,
    )
    src = torch.where(live, rows.long(), torch.argmax(live.to(torch.int32)))  # [B] the row whose states each row writes
    dst = slots[src]
    some = live.any()
    if ran_conv:
        conv_state[dst] = torch.where(some, conv_rows[src], conv_state[dst])
    ssm_state[dst] = torch.where(some, ssm_rows[src], ssm_state[dst])
    gated = rms_norm_gated_squares_ref(y.reshape(Bt, d_inner), z.contiguous(), norm_weight)
    g = torch.where(live[:, None], gated.g, 0).to(proj.dtype)  # [B, d_inner]
    sq = torch.where(live[:, None], gated.sq, 0).to(torch.float32)  # [B, K]
    return GatedSquares(g, sq)


def in_proj_conv_ref(
    hidden: Tensor | PendingNorm,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    *,
    state_indices: Tensor,
    conv_start: int,
    prefetch: L2Rows | None = None,
) -> tuple[Tensor, Tensor]:
    """in_proj, then the conv update of its xBC columns, for the decode rows of a step. `prefetch`
    (what a later kernel streams first) is a hint for the GPU kernel's timing (l2_prefetch.py):
    checked, without effect here.

      hidden         [B, K]                            the block's normalized input, or the pending
                                                       norm whose output it is (pending_norm.py)
      weight         [N, K], bias [N] or None          in_proj (N = d_inner + conv_dim + H)
      conv_state     [num_slots, conv_dim, width-1]    pool; conv_weight [conv_dim, width]
      state_indices  [B] int32                         pool slots (negative: CUDA-graph padding)
      conv_start                                       first xBC column of in_proj's output

    Returns (proj [B, N], xbc [B, conv_dim]: the conv's output with SiLU); conv state in place.
    """
    if prefetch is not None:
        check_hint("in_proj_conv", prefetch)
    proj = linear_pending_ref(hidden, weight, bias) if isinstance(hidden, PendingNorm) else linear_ref(hidden, weight,
                                                                                                    bias)
    conv_dim = conv_weight.shape[0]
    xbc = causal_conv1d_update_ref(proj[:, conv_start:conv_start + conv_dim], conv_state, conv_weight, conv_bias,
                                   state_indices=state_indices)
    return proj, xbc
