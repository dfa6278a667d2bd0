"""BambaForCausalLM (transformers' `bamba`): Mamba2 or attention mixer, then a SwiGLU FFN, per layer.

Each residual add runs in the kernel of the norm after it (`RMSNorm.add_forward`: the next layer's
input norm, the FFN's norm, the final norm), so a layer hands the next its FFN output and the
residual stream apart, as Mamba2 blocks do; the FFN's gate and up projections are one stacked
matmul (layers/mlp.py; the checkpoint's two tensors fill its halves: GATE_UP_STACK).

Numerics of the reference: residuals stay in the activation dtype (no residual_in_fp32);
attention rotates only the first head_dim * 0.5 dims (transformers hard-codes
partial_rotary_factor = 0.5 for Bamba), rotate_half convention; scale head_dim ** -0.5.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pd_ssm.cache.pool import CachePool
from pd_ssm.config import ModelConfig
from pd_ssm.engine.forward_meta import ForwardMeta
from pd_ssm.kernels.dispatch import Kernels
from pd_ssm.layers import Attention, GatedMLP, Mamba2Mixer, RMSNorm, RotaryEmbedding
from pd_ssm.models.base import CausalLM
from pd_ssm.models.weights import Shard, load_named_weights, stacked_name

# the checkpoint's FFN projections -> their halves of the stacked gate_up_proj
GATE_UP_STACK = {"gate_proj": Shard("gate_up_proj", 0, 2), "up_proj": Shard("gate_up_proj", 1, 2)}


class BambaDecoderLayer(nn.Module):
    """HF names: `mamba` or `self_attn`, `feed_forward`, `input_layernorm`, `pre_ff_layernorm`."""

    def __init__(self, config: ModelConfig, layer_idx: int, kernels: Kernels, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        act = config.hf.get("hidden_act", "silu")
        self.kind = config.layer_kinds[layer_idx]
        self.input_layernorm = RMSNorm(hidden, eps, kernels)
        if self.kind == "mamba":
            self.mamba = Mamba2Mixer(config, layer_idx=layer_idx, kernels=kernels, activation=act)
        else:
            self.self_attn = Attention(
                hidden, config.num_attention_heads, config.num_kv_heads, config.attn_head_dim,
                layer_idx=layer_idx, kernels=kernels, bias=config.attention_bias, rotary=rotary,
            )
        self.pre_ff_layernorm = RMSNorm(hidden, eps, kernels)
        self.feed_forward = GatedMLP(
            hidden, config.intermediate_size, kernels, act=act, bias=bool(config.hf.get("mlp_bias", False))
        )

    def forward(
        self, delta: torch.Tensor | None, residual: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
        cache: CachePool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(FFN output, residual stream without it): delta is the layer before's FFN output (None
        before the first layer), still to be added to `residual` (HF: hidden = hidden + ffn(...))."""
        x, residual = self.input_layernorm.add_forward(delta, residual, residual.dtype)
        if self.kind == "mamba":
            x = self.mamba(x, meta, cache)
        else:
            x = self.self_attn(x, positions, meta, cache)
        x, residual = self.pre_ff_layernorm.add_forward(x, residual, residual.dtype)
        return self.feed_forward(x), residual


class BambaModel(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        assert config.rope_theta is not None
        self.rotary_emb = RotaryEmbedding(config.attn_head_dim, config.rotary_dim, config.rope_theta)
        self.layers = nn.ModuleList(
            BambaDecoderLayer(config, i, kernels, self.rotary_emb) for i in range(config.num_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)


class BambaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, kernels: Kernels) -> None:
        super().__init__(config, kernels)
        self.model = BambaModel(config, kernels)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta, cache: CachePool
    ) -> torch.Tensor:
        residual = self.model.embed_tokens(input_ids)  # [T, hidden]
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            delta, residual = layer(delta, residual, positions, meta, cache)
            meta.layer_done(i)  # its cache pages are final: a streaming step may ship them now
        return self.model.final_layernorm.add_forward(delta, residual, residual.dtype).normed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = self.config.tie_word_embeddings

        def rename(name: str) -> str | Shard | None:
            return None if (name == "lm_head.weight" and tied) else stacked_name(name, GATE_UP_STACK)

        return load_named_weights(self, weights, rename, self.config.architecture)
