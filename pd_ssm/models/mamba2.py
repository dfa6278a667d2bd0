"""Mamba2ForCausalLM (transformers' `mamba2`): a stack of pre-norm Mamba2 mixer blocks.

Numerics of the reference: each block normalizes `hidden.to(norm dtype)`; with
`residual_in_fp32` (default True) the residual is upcast to fp32 before the add, so the hidden
stream is fp32 from the first block on and is rounded to the activation dtype only at the input
of each norm.  The final norm `norm_f` then sees fp32; the LM head casts to its own dtype.

The model keeps the residual stream; each block takes the previous block's output (None before
the first) and the stream, and does the residual add and its norm in one `add_rms_norm` kernel --
unless the previous block's mixer did the add itself and left this block's norm pending
(PendingBlock, layers/mixer2.py: decode steps of up to 32 rows on the Triton kernels), which needs
each block to know the next block's norm.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from pd_ssm.cache.pool import CachePool
from pd_ssm.config import ModelConfig
from pd_ssm.engine.forward_meta import ForwardMeta
from pd_ssm.kernels.dispatch import Kernels
from pd_ssm.kernels.pending_norm import PendingNorm
from pd_ssm.layers import Mamba2Mixer, RMSNorm
from pd_ssm.layers.norm import NormBoundary, PendingBlock, ScaledDelta
from pd_ssm.models.base import CausalLM
from pd_ssm.models.weights import load_named_weights


class Mamba2Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, kernels: Kernels) -> None:
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        # NOTE: every block output goes straight into the next block's add_rms_norm (or norm_f's), so
        # the mixer may hand it over with the gated norm's scale still to apply (ScaledDelta)
        self.mixer = Mamba2Mixer(
            config, layer_idx=layer_idx, kernels=kernels, activation=config.hf.get("hidden_act", "silu"),
            defer_norm_scale=True,
        )

    def forward(
        self, delta: torch.Tensor | ScaledDelta | PendingNorm | None, residual: torch.Tensor, meta: ForwardMeta,
        cache: CachePool, next_norm: RMSNorm | None = None, next_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | ScaledDelta | PendingNorm, torch.Tensor]:
        """(mixer output [T, hidden], residual stream [T, hidden] including delta). A PendingNorm delta:
        the previous block added its output to `residual` already and left this block's norm pending.
        `next_norm` (the next block's norm) lets the mixer do the same for the next block;
        `next_weight` (the next block's in_proj weight) is what the boundary's kernel asks L2 for."""
        residual_dtype = torch.float32 if self.residual_in_fp32 else residual.dtype
        normed: torch.Tensor | PendingNorm
        if isinstance(delta, PendingNorm):
            normed = delta
        else:
            normed, residual = self.norm.add_forward(delta, residual, residual_dtype)
        boundary = None if next_norm is None else NormBoundary(residual, residual_dtype, next_norm, next_weight)
        out = self.mixer(normed, meta, cache, boundary)
        if isinstance(out, PendingBlock):
            return out.pending, out.residual
        return out, residual


class Mamba2Backbone(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(config, i, kernels) for i in range(config.num_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)


class Mamba2ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, kernels: Kernels) -> None:
        super().__init__(config, kernels)
        self.backbone = Mamba2Backbone(config, kernels)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta, cache: CachePool
    ) -> torch.Tensor:
        residual = self.backbone.embeddings(input_ids)  # [T, hidden] in the activation dtype
        delta: torch.Tensor | ScaledDelta | PendingNorm | None = None
        layers = self.backbone.layers
        for i, layer in enumerate(layers):
            nxt = cast(Mamba2Block, layers[i + 1]) if i + 1 < len(layers) else None
            delta, residual = layer(delta, residual, meta, cache, None if nxt is None else nxt.norm,
                                    None if nxt is None else nxt.mixer.in_proj.weight)
            meta.layer_done(i)  # its cache pages are final: a streaming step may ship them now
        # NOTE: the last block has no next norm, so no PendingNorm reaches norm_f
        assert not isinstance(delta, PendingNorm)
        # NOTE: norm_f normalizes the stream in its own dtype (fp32 with residual_in_fp32, the weight
        # upcast), unlike the blocks' norms, which round it to the weight dtype first
        return self.backbone.norm_f.add_forward(delta, residual, residual.dtype, out_dtype=residual.dtype).normed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = self.config.tie_word_embeddings

        def rename(name: str) -> str | None:
            if name == "lm_head.weight" and tied:
                return None  # the embedding matrix serves as the head
            # checkpoints converted from mamba_ssm spell it `embedding` (HF renames it on load too)
            return name.replace("backbone.embedding.", "backbone.embeddings.")

        return load_named_weights(self, weights, rename, self.config.architecture)
