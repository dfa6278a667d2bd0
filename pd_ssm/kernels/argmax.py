"""Greedy sampling's argmax over each row of the logits: the reference.

Ties go to the first index, as torch.argmax (on the CPU and on CUDA). A NaN counts as larger than
every number, so a row with a NaN gives its first NaN's index, as torch.argmax does.
"""

from __future__ import annotations

from torch import Tensor


def check_logits(logits: Tensor) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"greedy_argmax: logits must be [N, V] with V > 0, got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        raise ValueError("greedy_argmax: logits must have stride 1 over the vocabulary")


def greedy_argmax_ref(logits: Tensor) -> Tensor:
    """logits [N, V] float -> [N] int64, each row's index of its largest value (the first of ties)."""
    check_logits(logits)
    return logits.argmax(dim=-1)
