"""Mamba2 SSD chunked scan over a varlen batch (the prefill half of the SSM).

Per head h, with the step size dt' = clamp(softplus(dt + dt_bias)) and the decay a = exp(dt' A[h]):

    state_t = a_t * state_{t-1} + dt'_t * (x_t ⊗ B_t)        [headdim, dstate]
    y_t     = state_t · C_t + D[h] * x_t                       [headdim]

The chunked form (SSD, "Transformers are SSMs", Dao & Gu 2024) evaluates this chunk by chunk:
inside a chunk as a causal quadratic form whose mask is the decay between two positions
(exp(segsum(dA))), across chunks by carrying the state from one chunk end to the next. That is
the algorithm the Triton kernel follows; `mamba_chunk_scan_varlen_ref` computes it with plain
torch ops in fp32 so it runs on any device and serves as the oracle for the kernel.

Chunk grid: chunk boundaries sit at ABSOLUTE positions that are multiples of `chunk_size`, not
at offsets from the start of this batch. A sequence resumed at `context_len % chunk_size != 0`
therefore starts mid-chunk (its first chunk is short), and the states at chunk boundaries are the
same whichever way a prompt was split into prefill chunks — which is what lets a prefix cache
reuse them. Rounding, not the math, is all the grid changes in `out` and the final state.

The decode half (one token per sequence) is `ssu.selective_state_update_ref`; both share
`discretize_dt`, so a prompt scanned in one call and a prompt scanned then stepped agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from pd_ssm.kernels._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_offsets,
    check_same_device,
    check_shape,
)

# NOTE: (0, inf) means "no limit" (mamba_ssm's and the HF configs' default time_step_limit)
NO_DT_LIMIT = (0.0, float("inf"))


class ScanOutput(NamedTuple):
    out: Tensor  # [T, nheads, headdim], dtype of x
    boundary_states: Tensor | None  # [N, nheads, headdim, dstate] fp32, states at chunk boundaries
    boundary_cu: Tensor | None  # [S+1] int32, offsets of each sequence's rows in boundary_states


def discretize_dt(
    dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool, dt_limit: Sequence[float]
) -> Tensor:
    """Raw dt [..., nheads] -> step sizes [..., nheads] in fp32.

    fp32 throughout, as mamba_ssm's kernels do (HF's torch path adds the bias in the activation
    dtype; identical in fp32). HF's chunk path clamps to (0, inf) unconditionally — after softplus
    that clamp is the identity, so skipping it when no limit is set is exact, and matches
    mamba_ssm when dt_softplus is off.
    """
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)  # threshold 20: above it softplus(x) == x, as in mamba_ssm and HF
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    if (lo, hi) != NO_DT_LIMIT:
        dt = dt.clamp(min=lo, max=hi)
    return dt


class _ChunkGrid(NamedTuple):
    token_index: Tensor  # [K, Q] int64: token of each chunk row; padding rows repeat the chunk's first
    valid: Tensor  # [K, Q] bool: False on the padding rows at the end of a short chunk
    first_chunk: list[int]  # [S] first chunk of each sequence
    num_chunks: list[int]  # [S]
    on_boundary: list[bool]  # [K] the chunk ends at an absolute multiple of chunk_size


def _chunk_grid(cu: list[int], ctx: list[int], chunk_size: int, device: torch.device) -> _ChunkGrid:
    starts: list[int] = []
    lengths: list[int] = []
    on_boundary: list[bool] = []
    first_chunk: list[int] = []
    for s in range(len(ctx)):
        t, end, pos = cu[s], cu[s + 1], ctx[s]
        first_chunk.append(len(starts))
        while t < end:
            n = min(chunk_size - pos % chunk_size, end - t)  # tokens up to the next absolute boundary
            starts.append(t)
            lengths.append(n)
            t, pos = t + n, pos + n
            on_boundary.append(pos % chunk_size == 0)
    num_chunks = [b - a for a, b in pairwise([*first_chunk, len(starts)])]
    start_t = torch.tensor(starts, dtype=torch.int64, device=device)  # [K]
    length_t = torch.tensor(lengths, dtype=torch.int64, device=device)  # [K]
    offs = torch.arange(chunk_size, device=device)  # [Q]
    valid = offs[None, :] < length_t[:, None]  # [K, Q]
    token_index = torch.where(valid, start_t[:, None] + offs[None, :], start_t[:, None])  # [K, Q]
    return _ChunkGrid(token_index, valid, first_chunk, num_chunks, on_boundary)


def _segsum(dA: Tensor) -> Tensor:
    """dA [..., Q] -> [..., Q, Q]: [l, s] = dA[s+1] + ... + dA[l] for s <= l, -inf above the diagonal.

    Each window is summed directly (cumsum of a masked matrix) instead of as cumsum[l] - cumsum[s]:
    the difference of two long running sums loses the small window sum to cancellation.
    """
    q = dA.shape[-1]
    ones = torch.ones(q, q, dtype=torch.bool, device=dA.device)
    rows = dA[..., :, None].expand(*dA.shape, q)  # [..., i, s] = dA[i]
    windows = rows.masked_fill(~ones.tril(-1), 0.0).cumsum(dim=-2)  # [..., l, s] = sum_{s<i<=l} dA[i]
    return windows.masked_fill(~ones.tril(0), float("-inf"))


def _check_scan_args(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, cu_seqlens: Tensor,
    context_lens: Tensor, ssm_state: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    D: Tensor | None, dt_bias: Tensor | None,
) -> None:
    k = "mamba_chunk_scan_varlen"
    check_ndim(k, "x", x, "[T, nheads, headdim]")
    check_ndim(k, "B", B, "[T, ngroups, dstate]")
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    S = cu_seqlens.shape[0] - 1
    if chunk_size <= 0:
        raise ValueError(f"{k}: chunk_size must be positive, got {chunk_size}")
    if G == 0 or H % G != 0:
        raise ValueError(f"{k}: nheads ({H}) must be a multiple of ngroups ({G})")
    check_shape(k, "dt", dt, "[T, nheads]", (T, H))
    check_shape(k, "A", A, "[nheads]", (H,))
    check_shape(k, "C", C, "[T, ngroups, dstate]", (T, G, N))
    check_ndim(k, "cu_seqlens", cu_seqlens, "[S+1]")
    for name, t in (("context_lens", context_lens), ("state_indices", state_indices),
                    ("has_initial_state", has_initial_state)):
        check_shape(k, name, t, "[S]", (S,))
    check_ndim(k, "ssm_state", ssm_state, "[num_slots, nheads, headdim, dstate]")
    check_shape(k, "ssm_state", ssm_state, "[num_slots, nheads, headdim, dstate]",
                (ssm_state.shape[0], H, P, N))
    for name, p in (("D", D), ("dt_bias", dt_bias)):
        if p is not None:
            check_shape(k, name, p, "[nheads]", (H,))
            check_dtype(k, name, p, FLOAT_DTYPES)
    for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C), ("ssm_state", ssm_state)):
        check_dtype(k, name, t, FLOAT_DTYPES)
    check_dtype(k, "A", A, (torch.float32,))
    for name, t in (("cu_seqlens", cu_seqlens), ("context_lens", context_lens),
                    ("state_indices", state_indices)):
        check_dtype(k, name, t, (torch.int32,))
    check_dtype(k, "has_initial_state", has_initial_state, (torch.bool,))
    for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C)):
        check_last_dim_contiguous(k, name, t)
    check_contiguous(k, "ssm_state", ssm_state)
    check_same_device(k, x=x, dt=dt, A=A, B=B, C=C, cu_seqlens=cu_seqlens, context_lens=context_lens,
                      ssm_state=ssm_state, state_indices=state_indices,
                      has_initial_state=has_initial_state, D=D, dt_bias=dt_bias)


def mamba_chunk_scan_varlen_ref(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    *,
    cu_seqlens: Tensor,
    context_lens: Tensor,
    ssm_state: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: Sequence[float] = NO_DT_LIMIT,
    return_boundary_states: bool = False,
    max_seqlen: int | None = None,
) -> ScanOutput:
    """Chunked SSD scan of S sequences laid end to end (T tokens), each from its own state.

    Shapes (T tokens, S sequences, H = nheads, P = headdim, G = ngroups, N = dstate):
      x                  [T, H, P]     fp32/bf16/fp16, stride 1 on the last axis
      dt                 [T, H]        raw, before dt_bias and softplus
      A                  [H]           fp32, already -exp(A_log)
      B, C               [T, G, N]     head h reads group h // (H // G)
      cu_seqlens         [S+1] int32   token offsets of the sequences; every sequence has >= 1 token
      context_lens       [S] int32     absolute position of each sequence's first token here
      ssm_state          [num_slots, H, P, N]  state pool (fp32, bf16 or fp16), contiguous
      state_indices      [S] int32     pool slot of each sequence; distinct
      has_initial_state  [S] bool      False: start from zeros, whatever the slot holds
      D, dt_bias         [H] or None

    In place: ssm_state[state_indices[s]] <- the state after the last token of s (cast to the
    pool's dtype); no other slot is touched. The initial states are all read before any is written.

    Returns ScanOutput(out [T, H, P] in x.dtype, boundary_states, boundary_cu). With
    return_boundary_states, boundary_states [num_boundaries, H, P, N] fp32 holds for each sequence,
    in increasing order, the state after token p-1 for every absolute position p with
    p % chunk_size == 0 and context_len < p <= context_len + len, and rows
    boundary_cu[s]:boundary_cu[s+1] belong to sequence s; otherwise both are None.

    max_seqlen: the longest sequence's length when the caller knows it on the host (None: unknown),
    a hint that picks the Triton launcher's path (ssd_triton.py); it never changes the results, and
    this reference ignores it.

    Reads cu_seqlens and context_lens on the host (one device sync); the Triton kernel does not.
    """
    _check_scan_args(x, dt, A, B, C, chunk_size, cu_seqlens, context_lens, ssm_state, state_indices,
                     has_initial_state, D, dt_bias)
    k = "mamba_chunk_scan_varlen"
    T, H, P = x.shape
    G = B.shape[1]
    cu: list[int] = cu_seqlens.tolist()
    ctx: list[int] = context_lens.tolist()
    check_offsets(k, "cu_seqlens", cu, T)
    if any(c < 0 for c in ctx):
        raise ValueError(f"{k}: context_lens must be >= 0, got {ctx}")

    grid = _chunk_grid(cu, ctx, chunk_size, x.device)
    idx, valid = grid.token_index, grid.valid  # [K, Q]
    dt_f = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # [T, H] fp32
    Bh = B.float().repeat_interleave(H // G, dim=1)  # [T, H, N]
    Ch = C.float().repeat_interleave(H // G, dim=1)  # [T, H, N]

    # Gather every chunk into a padded [K, Q, ...] block. A padding row gets dt = 0, so its decay
    # is exp(0) = 1 and its input dt * x is 0: it changes neither the chunk's state nor its outputs.
    dt_c = dt_f[idx] * valid[..., None]  # [K, Q, H]
    x_c = x.float()[idx]  # [K, Q, H, P]
    B_c, C_c = Bh[idx], Ch[idx]  # [K, Q, H, N]
    xdt = x_c * dt_c[..., None]  # [K, Q, H, P]
    dA = dt_c * A[None, None, :]  # [K, Q, H], log of the per-token decay
    dA_cum = dA.cumsum(dim=1)  # [K, Q, H], log decay from the chunk start through token l

    # 1. Intra-chunk (diagonal blocks): y_l = sum_{s<=l} (C_l . B_s) exp(dA_(s, l]) dt_s x_s
    decay = torch.exp(_segsum(dA.transpose(1, 2)))  # [K, H, Q(l), Q(s)], 0 above the diagonal
    scores = torch.einsum("klhn,kshn->khls", C_c, B_c) * decay  # [K, H, Q, Q]
    y = torch.einsum("khls,kshp->klhp", scores, xdt)  # [K, Q, H, P]

    # 2. Each chunk's own contribution to the state at its end (as if it started from zero)
    to_end = torch.exp(dA_cum[:, -1:, :] - dA_cum)  # [K, Q, H], decay from token s to the chunk end
    chunk_states = torch.einsum("kshn,ksh,kshp->khpn", B_c, to_end, xdt)  # [K, H, P, N]
    chunk_decay = torch.exp(dA_cum[:, -1, :])  # [K, H], decay across the whole chunk

    # 3. Inter-chunk state passing, sequentially along each sequence from its initial state
    pool_states = ssm_state[state_indices.long()].float()  # [S, H, P, N]
    init = torch.where(has_initial_state[:, None, None, None], pool_states, 0.0)  # [S, H, P, N]
    start_states = torch.empty_like(chunk_states)  # [K, H, P, N]
    end_states = torch.empty_like(chunk_states)  # [K, H, P, N]
    for s, (first, n) in enumerate(zip(grid.first_chunk, grid.num_chunks, strict=True)):
        state = init[s]  # [H, P, N]
        for c in range(first, first + n):
            start_states[c] = state
            state = chunk_decay[c][:, None, None] * state + chunk_states[c]
            end_states[c] = state

    # 4. Off-diagonal blocks: what the chunk's start state contributes, decayed up to token l
    y = y + torch.exp(dA_cum)[..., None] * torch.einsum("klhn,khpn->klhp", C_c, start_states)
    if D is not None:
        y = y + x_c * D.float()[:, None]  # D skip in fp32

    out = y[valid].to(x.dtype)  # [T, H, P]: chunks are in token order, so the valid rows are too
    last_chunks = [f + n - 1 for f, n in zip(grid.first_chunk, grid.num_chunks, strict=True)]
    final = end_states[torch.tensor(last_chunks, dtype=torch.int64, device=x.device)]  # [S, H, P, N]
    ssm_state.index_copy_(0, state_indices.long(), final.to(ssm_state.dtype))

    if not return_boundary_states:
        return ScanOutput(out, None, None)
    rows: list[int] = []
    boundary_cu = [0]
    for first, n in zip(grid.first_chunk, grid.num_chunks, strict=True):
        rows += [c for c in range(first, first + n) if grid.on_boundary[c]]
        boundary_cu.append(len(rows))
    boundary_states = end_states[torch.tensor(rows, dtype=torch.int64, device=x.device)]  # [N, H, P, N]
    return ScanOutput(out, boundary_states, torch.tensor(boundary_cu, dtype=torch.int32, device=x.device))
