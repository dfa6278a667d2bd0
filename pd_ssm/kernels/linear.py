"""The model's linear layers, torch reference: `linear_ref` is torch's own F.linear (cuBLAS on CUDA).

The Triton backend's `linear_triton` (skinny_linear_triton.py) streams the weights itself for decode
steps of a few rows, where that was measured faster, and calls this everywhere else.
"""

from __future__ import annotations

import torch
from torch import Tensor


def linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), in x's dtype."""
    return torch.nn.functional.linear(x, weight, bias)
