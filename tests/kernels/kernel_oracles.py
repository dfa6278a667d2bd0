"""Oracles and input builders for the kernel tests.

The oracles are the plainest possible statement of each recurrence, token by token in float64,
written independently of the chunked / batched references they check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

INF_LIMIT = (0.0, math.inf)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def i32(values: Sequence[int] | Sequence[bool]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


def compiled_ptx(kernel: Any) -> list[str]:
    """The PTX of every variant of a @triton.jit function Triton has compiled on the current CUDA
    device in this process (its kernel cache: the first entry of `device_caches[device]`)."""
    return [k.asm["ptx"] for k in kernel.device_caches[torch.cuda.current_device()][0].values()]


def cu_of(lengths: Sequence[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def assert_close(actual: Tensor, expected: Tensor, rtol: float, atol: float, msg: str = "") -> None:
    """Compare in float64: the error of `actual` against an oracle, not rounding of the comparison."""
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=msg or None)


# --- SSM -------------------------------------------------------------------------------------


@dataclass
class SSMInputs:
    x: Tensor  # [T, H, P]
    dt: Tensor  # [T, H]
    A: Tensor  # [H] fp32
    B: Tensor  # [T, G, N]
    C: Tensor  # [T, G, N]
    D: Tensor  # [H] fp32
    dt_bias: Tensor  # [H] fp32


def make_ssm_inputs(
    g: torch.Generator, T: int, H: int, P: int, G: int, N: int, dtype: torch.dtype = torch.float32
) -> SSMInputs:
    # dt around softplus(-1..1) and A in [-e, -1/e]: decays exp(dt A) spread over (0.05, 0.9)
    return SSMInputs(
        x=torch.randn(T, H, P, generator=g).to(dtype),
        dt=(torch.rand(T, H, generator=g) * 2 - 1.5).to(dtype),
        A=-torch.exp(torch.rand(H, generator=g) * 2 - 1),
        B=torch.randn(T, G, N, generator=g).to(dtype),
        C=torch.randn(T, G, N, generator=g).to(dtype),
        D=torch.randn(H, generator=g),
        dt_bias=torch.rand(H, generator=g) - 0.5,
    )


def naive_dt(dt: Tensor, dt_bias: Tensor | None, softplus: bool, limit: Sequence[float]) -> Tensor:
    dt = dt.double() + (0.0 if dt_bias is None else dt_bias.double())
    if softplus:
        dt = torch.log1p(torch.exp(dt))
    if tuple(limit) != INF_LIMIT:
        dt = dt.clamp(min=limit[0], max=limit[1])
    return dt


def naive_ssm(
    inp: SSMInputs,
    cu: Sequence[int],
    init: Tensor,
    *,
    use_D: bool = True,
    use_bias: bool = True,
    softplus: bool = True,
    limit: Sequence[float] = INF_LIMIT,
) -> tuple[Tensor, Tensor]:
    """Token-by-token recurrence in float64.

    init [S, H, P, N]: each sequence's initial state. Returns (y [T, H, P], state after each token
    [T, H, P, N]).
    """
    T, H, P = inp.x.shape
    G, N = inp.B.shape[1:]
    dt = naive_dt(inp.dt, inp.dt_bias if use_bias else None, softplus, limit)  # [T, H]
    A, x = inp.A.double(), inp.x.double()
    B = inp.B.double().repeat_interleave(H // G, dim=1)  # [T, H, N]
    C = inp.C.double().repeat_interleave(H // G, dim=1)  # [T, H, N]
    y = torch.empty(T, H, P, dtype=torch.float64)
    states = torch.empty(T, H, P, N, dtype=torch.float64)
    for s in range(len(cu) - 1):
        h = init[s].double().clone()  # [H, P, N]
        for t in range(cu[s], cu[s + 1]):
            h = torch.exp(dt[t] * A)[:, None, None] * h + dt[t][:, None, None] * x[t][:, :, None] * B[t][:, None, :]
            y[t] = (h * C[t][:, None, :]).sum(-1)
            if use_D:
                y[t] += inp.D.double()[:, None] * x[t]
            states[t] = h
    return y, states


# --- conv ------------------------------------------------------------------------------------


def naive_conv(history: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, silu: bool) -> Tensor:
    """history [dim, W-1] then x [L, dim] -> out [L, dim] float64, one dot product per output."""
    W = weight.shape[1]
    seq = torch.cat([history.double(), x.double().T], dim=1)  # [dim, W-1+L]
    out = torch.stack(
        [(seq[:, t:t + W] * weight.double()).sum(-1) for t in range(x.shape[0])]
    )  # [L, dim]
    if bias is not None:
        out = out + bias.double()
    return out * torch.sigmoid(out) if silu else out


# --- attention -------------------------------------------------------------------------------


def naive_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Full causal attention over one sequence, float64. q [L, H, D]; k, v [L, Hkv, D]."""
    H, Hkv = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(H // Hkv, dim=1)  # [L, H, D]
    vv = v.double().repeat_interleave(H // Hkv, dim=1)  # [L, H, D]
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale  # [H, L, L]
    L = q.shape[0]
    scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vv)  # [L, H, D]
