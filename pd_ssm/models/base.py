"""The contract every model family implements (one file per family beside this one)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from pd_ssm.cache.pool import CachePool
from pd_ssm.config import ModelConfig
from pd_ssm.engine.forward_meta import ForwardMeta
from pd_ssm.kernels.dispatch import Kernels


class CausalLM(nn.Module, ABC):
    """A decoder-only LM over a flat varlen batch whose recurrent state and KV live in a CachePool.

    The model holds no per-request state: everything a request carries between steps is in the
    pool slots and blocks named by `ForwardMeta`, which is what makes a request movable between
    engines (StatePages) and preemptible (free the slot, recompute later).
    """

    config: ModelConfig

    def __init__(self, config: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, absolute positions
        meta: ForwardMeta,
        cache: CachePool,
    ) -> torch.Tensor:  # [T, hidden] final-normed hidden states
        ...

    lm_head: nn.Linear

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (only the rows the sampler needs are passed in); into
        `out` [N, vocab] fp32 where given (kernels' `logits`: linear.logits_ref)."""
        weight = self.lm_head.weight
        return self.kernels.logits(hidden.to(weight.dtype), weight, out)

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters; return the parameter names that were filled.

        The loader compares that set with `named_parameters()` and names any missing tensor.
        """
