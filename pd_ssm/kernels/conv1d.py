"""Causal depthwise conv1d of the Mamba2 mixer (over x, B and C together), varlen and decode.

Conv state layout (the same on prefill and decode workers; it is what StatePages ship):

    conv_state  [num_slots, dim, width - 1]

slot s holds the last width-1 conv INPUTS of its sequence (pre-conv, pre-activation), oldest
first: index width-2 is the most recent token. A sequence that has seen fewer than width-1 tokens
has zeros in front (the conv's causal zero padding), so "no history" and "zeros" are the same.

Numerics follow HF's torch path: the conv runs in the input dtype (F.conv1d, like nn.Conv1d),
then the activation in the same dtype. History read from a pool of another dtype is cast to the
input dtype; the new history is cast back to the pool's dtype (lossless when both agree).
"""

from __future__ import annotations

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


def _check_conv_args(
    k: str, x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, state_indices: Tensor,
    num_seqs: int, activation: str | None,
) -> None:
    check_ndim(k, "x", x, "[T, dim]")
    check_ndim(k, "weight", weight, "[dim, width]")
    dim, width = weight.shape
    if width < 2:
        raise ValueError(f"{k}: conv width must be >= 2 (the state holds width-1 inputs), got {width}")
    check_shape(k, "x", x, "[T, dim]", (x.shape[0], dim))
    if bias is not None:
        check_shape(k, "bias", bias, "[dim]", (dim,))
        check_dtype(k, "bias", bias, (x.dtype,))
    check_ndim(k, "conv_state", conv_state, "[num_slots, dim, width-1]")
    check_shape(k, "conv_state", conv_state, "[num_slots, dim, width-1]",
                (conv_state.shape[0], dim, width - 1))
    check_shape(k, "state_indices", state_indices, "[S]", (num_seqs,))
    check_dtype(k, "x", x, FLOAT_DTYPES)
    # NOTE: HF casts x to the weight's dtype before the conv; requiring equality keeps one rounding
    check_dtype(k, "weight", weight, (x.dtype,))
    check_dtype(k, "conv_state", conv_state, FLOAT_DTYPES)
    check_dtype(k, "state_indices", state_indices, (torch.int32,))
    check_last_dim_contiguous(k, "x", x)
    check_contiguous(k, "conv_state", conv_state)
    if activation not in (None, "silu"):
        raise ValueError(f"{k}: activation must be None or 'silu', got {activation!r}")
    check_same_device(k, x=x, weight=weight, bias=bias, conv_state=conv_state, state_indices=state_indices)


def _activate(y: Tensor, activation: str | None) -> Tensor:
    return F.silu(y) if activation == "silu" else y


def causal_conv1d_varlen_ref(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    *,
    cu_seqlens: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    activation: str | None = "silu",
) -> Tensor:
    """Causal conv over S sequences laid end to end, each continuing from its own history.

    Shapes:
      x                  [T, dim]                    fp32/bf16/fp16, stride 1 on the last axis
      weight             [dim, width]                dtype of x
      bias               [dim] or None               dtype of x
      conv_state         [num_slots, dim, width-1]   pool, contiguous (layout: module docstring)
      cu_seqlens         [S+1] int32                 token offsets; every sequence has >= 1 token
      state_indices      [S] int32                   pool slot of each sequence; distinct
      has_initial_state  [S] bool                    False: zeros as history, whatever the slot holds

    In place: conv_state[state_indices[s]] <- the last width-1 inputs of (history ++ new tokens),
    so a sequence shorter than width-1 keeps the newest part of its old history. Histories are all
    read before any is written. Returns out [T, dim] in x.dtype.
    Reads cu_seqlens on the host (one device sync); the Triton kernel does not.
    """
    k = "causal_conv1d_varlen"
    num_seqs = cu_seqlens.shape[0] - 1
    _check_conv_args(k, x, weight, bias, conv_state, state_indices, num_seqs, activation)
    check_ndim(k, "cu_seqlens", cu_seqlens, "[S+1]")
    check_dtype(k, "cu_seqlens", cu_seqlens, (torch.int32,))
    check_shape(k, "has_initial_state", has_initial_state, "[S]", (num_seqs,))
    check_dtype(k, "has_initial_state", has_initial_state, (torch.bool,))
    check_same_device(k, x=x, cu_seqlens=cu_seqlens, has_initial_state=has_initial_state)
    T, dim = x.shape
    cu: list[int] = cu_seqlens.tolist()
    check_offsets(k, "cu_seqlens", cu, T)

    slots = state_indices.long()  # [S]
    history = conv_state[slots].to(x.dtype)  # [S, dim, width-1]
    history = torch.where(has_initial_state[:, None, None], history, 0.0)  # [S, dim, width-1]
    w = weight[:, None, :]  # [dim, 1, width], the depthwise layout of nn.Conv1d(groups=dim)
    out = torch.empty_like(x)  # [T, dim]
    new_history = torch.empty_like(history)  # [S, dim, width-1]
    for s in range(num_seqs):
        seq = torch.cat([history[s], x[cu[s]:cu[s + 1]].T], dim=-1)  # [dim, width-1 + L]
        # no padding: the width-1 history columns in front are exactly the causal left context
        out[cu[s]:cu[s + 1]] = F.conv1d(seq[None], w, bias, groups=dim)[0].T  # [L, dim]
        new_history[s] = seq[:, -(weight.shape[1] - 1):]
    conv_state.index_copy_(0, slots, new_history.to(conv_state.dtype))
    return _activate(out, activation)


def causal_conv1d_update_ref(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    state_indices: Tensor,
    activation: str | None = "silu",
) -> Tensor:
    """One new token for each of B sequences (decode).

    Shapes:
      x              [B, dim]                    fp32/bf16/fp16, stride 1 on the last axis
      conv_state     [num_slots, dim, width-1]   pool, contiguous (layout: module docstring)
      weight         [dim, width]                dtype of x
      bias           [dim] or None               dtype of x
      state_indices  [B] int32                   pool slot of each sequence; distinct

    In place: conv_state[state_indices[b]] shifts left by one and takes x[b] as its newest column.
    Returns out [B, dim] in x.dtype. No host synchronization.
    """
    k = "causal_conv1d_update"
    _check_conv_args(k, x, weight, bias, conv_state, state_indices, x.shape[0], activation)
    dim = x.shape[1]
    slots = state_indices.long()  # [B]
    window = torch.cat([conv_state[slots].to(x.dtype), x[:, :, None]], dim=-1)  # [B, dim, width]
    out = F.conv1d(window, weight[:, None, :], bias, groups=dim)[:, :, 0]  # [B, dim]
    conv_state.index_copy_(0, slots, window[:, :, 1:].to(conv_state.dtype))
    return _activate(out, activation)
