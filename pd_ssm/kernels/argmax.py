"""Greedy sampling's argmax over each row of the logits: the reference.

Ties go to the first index, as torch.argmax (on the CPU and on CUDA). A NaN counts as larger than
every number, so a row with a NaN gives its first NaN's index, as torch.argmax does.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_logits(logits: Tensor) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"greedy_argmax: logits must be [N, V] with V > 0, got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        raise ValueError("greedy_argmax: logits must have stride 1 over the vocabulary")


def check_host_out(logits: Tensor, host_out: Tensor | None) -> None:
    if host_out is not None and (host_out.shape != (logits.shape[0],) or host_out.dtype != torch.int64
                                 or host_out.device.type != "cpu" or not host_out.is_contiguous()):
        raise ValueError(f"greedy_argmax: host_out must be a contiguous [N] = [{logits.shape[0]}] int64 host "
                         f"tensor (pinned for CUDA logits), got {tuple(host_out.shape)} {host_out.dtype} "
                         f"on {host_out.device}")


def greedy_argmax_ref(logits: Tensor, host_out: Tensor | None = None) -> Tensor:
    """logits [N, V] float -> [N] int64 on logits' device, each row's index of its largest value (the
    first of ties). host_out [N] int64 on the host (pinned where logits are on CUDA): the tokens are
    written there too, by the time the stream reaches the next event recorded on it."""
    check_logits(logits)
    check_host_out(logits, host_out)
    tokens = logits.argmax(dim=-1)
    if host_out is not None:
        host_out.copy_(tokens, non_blocking=True)
    return tokens
