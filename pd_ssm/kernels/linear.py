"""The model's linear layers, torch references: `linear_ref` is torch's own F.linear (cuBLAS on CUDA),
`logits_ref` the lm_head's fp32 logits.

The Triton backend's `linear_triton` and `logits_triton` (skinny_linear_triton.py) stream the weights
themselves for decode steps of a few rows, where that was measured faster, and call these
everywhere else.
"""

from __future__ import annotations

import torch
from torch import Tensor


def linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), in x's dtype."""
    return torch.nn.functional.linear(x, weight, bias)


def logits_ref(hidden: Tensor, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """[M, vocab] fp32 logits = hidden [M, K] @ weight [vocab, K]^T (hidden in weight's dtype); into
    `out` [M, vocab] fp32 where given. On CUDA with bf16 / fp16 weights one cuBLAS launch writes the
    fp32 sums; elsewhere they are rounded to the weight's dtype first (transformers' lm_head, then
    .float())."""
    if weight.is_cuda and weight.dtype != torch.float32:
        # NOTE: cuBLAS writes the fp32 logits of its fp32 sums, where linear + cast rounded them to the
        # weight's dtype first and took a cast launch (RESULTS.md, session 21)
        if out is None:
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32, out=out)
    logits = torch.nn.functional.linear(hidden, weight)
    if out is None:
        return logits.float()
    return out.copy_(logits)
