"""Selective state update: one decode step of the Mamba2 SSM per sequence, in place on the pool.

    state <- exp(dt' A) * state + (dt' * B) ⊗ x        dt' = clamp(softplus(dt + dt_bias))
    y      = state · C + D * x

The same recurrence as `ssd.mamba_chunk_scan_varlen_ref`, one token at a time, with the same
`discretize_dt`; scanning n tokens equals scanning n-k and stepping k times.

dt_limit: HF's decode step (and mamba_ssm's / vLLM's) never clamps dt, while their chunked scan
does. For a model whose time_step_limit is not (0, inf) (e.g. NemotronH), passing the model's
limit here keeps prefill and decode consistent; passing the default reproduces HF's decode.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pd_ssm.kernels._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    check_shape,
)
from pd_ssm.kernels.ssd import NO_DT_LIMIT, discretize_dt


def selective_state_update_ref(
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
    """One SSM step for each of Bt sequences.

    Shapes (H = nheads, P = headdim, G = ngroups, N = dstate):
      ssm_state      [num_slots, H, P, N]  state pool (fp32, bf16 or fp16), contiguous
      x              [Bt, H, P]            fp32/bf16/fp16, stride 1 on the last axis
      dt             [Bt, H]               raw, before dt_bias and softplus
      A              [H]                   fp32, already -exp(A_log)
      B, C           [Bt, G, N]            head h reads group h // (H // G)
      state_indices  [Bt] int32            pool slot of each sequence; distinct
      D, dt_bias     [H] or None

    In place: ssm_state[state_indices[b]] <- the new state (cast to the pool's dtype); no other slot
    is touched. Returns y [Bt, H, P] in x.dtype; all math in fp32 (y is taken from the fp32 state,
    before the cast to the pool's dtype). No host synchronization.
    """
    check_ssu_args(ssm_state, x, dt, A, B, C, state_indices, D, dt_bias)
    H, G = x.shape[1], B.shape[1]

    slots = state_indices.long()  # [Bt]
    dt_f = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # [Bt, H] fp32
    dA = torch.exp(dt_f * A)  # [Bt, H]
    Bh = B.float().repeat_interleave(H // G, dim=1)  # [Bt, H, N]
    Ch = C.float().repeat_interleave(H // G, dim=1)  # [Bt, H, N]
    xf = x.float()  # [Bt, H, P]
    # (dt * B) first, then times x: the order of HF's decode step, so fp32 results agree to the ulp
    dBx = (dt_f[..., None] * Bh)[:, :, None, :] * xf[..., None]  # [Bt, H, P, N]
    state = ssm_state[slots].float() * dA[..., None, None] + dBx  # [Bt, H, P, N]
    y = torch.matmul(state, Ch[..., None]).squeeze(-1)  # [Bt, H, P]
    if D is not None:
        y = y + xf * D.float()[:, None]  # D skip in fp32
    ssm_state.index_copy_(0, slots, state.to(ssm_state.dtype))
    return y.to(x.dtype)


def check_ssu_args(
    ssm_state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state_indices: Tensor,
    D: Tensor | None, dt_bias: Tensor | None,
) -> None:
    """Shape, dtype, layout and device checks shared by the reference and the Triton launcher."""
    k = "selective_state_update"
    check_ndim(k, "x", x, "[Bt, nheads, headdim]")
    check_ndim(k, "B", B, "[Bt, ngroups, dstate]")
    Bt, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if G == 0 or H % G != 0:
        raise ValueError(f"{k}: nheads ({H}) must be a multiple of ngroups ({G})")
    check_ndim(k, "ssm_state", ssm_state, "[num_slots, nheads, headdim, dstate]")
    check_shape(k, "ssm_state", ssm_state, "[num_slots, nheads, headdim, dstate]",
                (ssm_state.shape[0], H, P, N))
    check_shape(k, "dt", dt, "[Bt, nheads]", (Bt, H))
    check_shape(k, "A", A, "[nheads]", (H,))
    check_shape(k, "C", C, "[Bt, ngroups, dstate]", (Bt, G, N))
    check_shape(k, "state_indices", state_indices, "[Bt]", (Bt,))
    for name, p in (("D", D), ("dt_bias", dt_bias)):
        if p is not None:
            check_shape(k, name, p, "[nheads]", (H,))
            check_dtype(k, name, p, FLOAT_DTYPES)
    for name, t in (("ssm_state", ssm_state), ("x", x), ("dt", dt), ("B", B), ("C", C)):
        check_dtype(k, name, t, FLOAT_DTYPES)
    check_dtype(k, "A", A, (torch.float32,))
    check_dtype(k, "state_indices", state_indices, (torch.int32,))
    for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C)):
        check_last_dim_contiguous(k, name, t)
    check_contiguous(k, "ssm_state", ssm_state)
    check_same_device(k, ssm_state=ssm_state, x=x, dt=dt, A=A, B=B, C=C, state_indices=state_indices,
                      D=D, dt_bias=dt_bias)
