"""NemotronHForCausalLM (transformers' `nemotron_h`): one mixer per block — Mamba2, attention or MLP.

Numerics of the reference: block = residual + mixer(norm(hidden.to(norm dtype))); the residual
stays in the activation dtype (transformers ignores `residual_in_fp32` here); the plain RMSNorms
multiply by the weight in fp32 before casting (the gated one does not); attention has no
positional embedding and no biases; the MLP is up -> relu2 -> down; the mixer clamps dt to
(time_step_min, inf) (normalized into ModelConfig.time_step_limit).  Checkpoints name the trunk
`backbone.` (transformers renames it to `model.` on load; both spellings are accepted here).

Each residual add runs in the kernel of the norm after it (`RMSNorm.add_forward`: the next block's
norm, the final norm), so a block hands the next its mixer output and the residual stream apart.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pd_ssm.cache.pool import CachePool
from pd_ssm.config import ModelConfig
from pd_ssm.engine.forward_meta import ForwardMeta
from pd_ssm.kernels.dispatch import Kernels
from pd_ssm.layers import MLP, Attention, Mamba2Mixer, RMSNorm
from pd_ssm.models.base import CausalLM
from pd_ssm.models.weights import load_named_weights


class NemotronHBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, kernels: Kernels) -> None:
        super().__init__()
        self.kind = config.layer_kinds[layer_idx]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, weight_in_fp32=True)
        self.mixer: nn.Module
        if self.kind == "mamba":
            act = config.hf.get("mamba_hidden_act", "silu")
            self.mixer = Mamba2Mixer(config, layer_idx=layer_idx, kernels=kernels, activation=act)
        elif self.kind == "attention":
            self.mixer = Attention(
                config.hidden_size, config.num_attention_heads, config.num_kv_heads, config.attn_head_dim,
                layer_idx=layer_idx, kernels=kernels, bias=False, rotary=None,
            )
        else:
            self.mixer = MLP(
                config.hidden_size, config.intermediate_size, kernels,
                act=config.hf.get("mlp_hidden_act", "relu2"), bias=bool(config.hf.get("mlp_bias", False)),
            )

    def forward(
        self, delta: torch.Tensor | None, residual: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
        cache: CachePool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mixer output, residual stream without it): delta is the block before's mixer output (None
        before the first block), still to be added to `residual` (HF: residual + mixer(norm(...)))."""
        # NOTE: HF normalizes hidden.to(norm weight dtype): add_forward rounds the sum to it as well
        x, residual = self.norm.add_forward(delta, residual, residual.dtype)
        if self.kind == "mamba":
            x = self.mixer(x, meta, cache)
        elif self.kind == "attention":
            x = self.mixer(x, positions, meta, cache)
        else:
            x = self.mixer(x)
        return x, residual


class NemotronHBackbone(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(config, i, kernels) for i in range(config.num_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, weight_in_fp32=True)


class NemotronHForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, kernels: Kernels) -> None:
        super().__init__(config, kernels)
        self.backbone = NemotronHBackbone(config, kernels)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta, cache: CachePool
    ) -> torch.Tensor:
        residual = self.backbone.embeddings(input_ids)  # [T, hidden]
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.backbone.layers):
            delta, residual = layer(delta, residual, positions, meta, cache)
            meta.layer_done(i)  # its cache pages are final: a streaming step may ship them now
        return self.backbone.norm_f.add_forward(delta, residual, residual.dtype).normed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = self.config.tie_word_embeddings

        def rename(name: str) -> str | None:
            if name.startswith("mtp.") or (name == "lm_head.weight" and tied):
                return None  # multi-token-prediction heads: transformers skips them as well
            return "backbone." + name.removeprefix("model.") if name.startswith("model.") else name

        return load_named_weights(self, weights, rename, self.config.architecture)
