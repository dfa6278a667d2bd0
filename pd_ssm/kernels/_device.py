"""Where a Triton launch runs: on the tensors' CUDA device, and how many SMs it has."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor


def on_device(t: Tensor) -> AbstractContextManager[object]:
    """The launch context of a kernel over `t`."""
    # NOTE: Triton launches on the current CUDA device, which need not be the tensors' one
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 4 elsewhere (the interpreter's grids stay small)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
