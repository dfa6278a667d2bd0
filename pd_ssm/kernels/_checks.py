"""Argument checks shared by the kernel launchers.

Every launcher validates its arguments before touching memory: a wrong shape that happens to
broadcast, or a state pool of the wrong dtype, would otherwise corrupt a state slot silently.
The checks only read shapes, dtypes, strides and devices, never tensor values, so they cost no
device synchronization.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_shape(kernel: str, name: str, t: Tensor, dims: str, expected: Sequence[int]) -> None:
    """`dims` names the axes for the message, e.g. "[T, nheads, headdim]"."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(
            f"{kernel}: {name} must have shape {dims} = {tuple(expected)}, got {tuple(t.shape)}"
        )


def check_ndim(kernel: str, name: str, t: Tensor, dims: str) -> None:
    ndim = dims.count(",") + 1
    if t.dim() != ndim:
        raise ValueError(f"{kernel}: {name} must be {ndim}-D {dims}, got shape {tuple(t.shape)}")


def check_dtype(kernel: str, name: str, t: Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{kernel}: {name} must be one of ({names}), got {t.dtype}")


def check_last_dim_contiguous(kernel: str, name: str, t: Tensor) -> None:
    # NOTE: the Triton kernels take arbitrary strides on the outer axes but vector-load the last one
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{kernel}: {name} must have stride 1 on its last axis, got strides {t.stride()}; "
            "pass .contiguous()"
        )


def check_contiguous(kernel: str, name: str, t: Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{kernel}: {name} must be contiguous (a pool is written in place through a view)")


def check_same_device(kernel: str, **tensors: Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name}={dev}" for name, dev in devices.items())
        raise ValueError(f"{kernel}: all tensors must be on one device, got {listing}")


def check_offsets(kernel: str, name: str, offsets: list[int], total: int) -> None:
    """Host copy of a [S+1] offsets tensor: rises strictly (no empty sequence) from 0 to `total`."""
    if offsets[0] != 0 or offsets[-1] != total or any(b <= a for a, b in pairwise(offsets)):
        raise ValueError(f"{kernel}: {name} must rise strictly from 0 to {total}, got {offsets}")
