"""The cache tensors: per-SSM-layer conv and SSM state pools, per-attention-layer KV block pools.

Bookkeeping (which slot or block belongs to which request) lives in `cache/manager.py`; this file
only owns memory.  Layouts (documented once, identical on prefill and decode workers):

  conv_state[l]  [num_slots, conv_dim, d_conv - 1]   the last d_conv-1 conv *inputs*, oldest first
  ssm_state[l]   [num_slots, nheads, headdim, dstate] fp32 by default (--mamba-ssm-cache-dtype)
  k_cache[l]     [num_blocks, block_size, num_kv_heads, head_dim]
  v_cache[l]     [num_blocks, block_size, num_kv_heads, head_dim]

`l` counts SSM layers (resp. attention layers) in model order, not decoder-layer indices:
`ssm_index[layer_idx]` and `attn_index[layer_idx]` translate.
"""

from __future__ import annotations

import torch

from pd_ssm.config import CacheConfig, ModelConfig


class CachePool:
    def __init__(
        self,
        model: ModelConfig,
        cache: CacheConfig,
        device: torch.device | str,
        act_dtype: torch.dtype,
    ) -> None:
        self.model_config = model
        self.cache_config = cache
        self.device = torch.device(device)
        self.num_slots = cache.num_state_slots
        self.num_blocks = cache.num_kv_blocks
        self.block_size = cache.block_size
        state_dtype = cache.cache_dtype or act_dtype
        self.ssm_index = {layer: i for i, layer in enumerate(model.mamba_layer_ids)}
        self.attn_index = {layer: i for i, layer in enumerate(model.attention_layer_ids)}
        n_ssm, n_attn = len(self.ssm_index), len(self.attn_index)
        # NOTE: one stacked tensor per kind so exporting a slot across all layers is one gather
        self.conv_state = torch.zeros(
            n_ssm, self.num_slots, model.mamba_conv_dim, model.mamba_d_conv - 1,
            dtype=state_dtype, device=self.device,
        )
        self.ssm_state = torch.zeros(
            n_ssm, self.num_slots, model.mamba_num_heads, model.mamba_head_dim, model.mamba_d_state,
            dtype=cache.mamba_ssm_cache_dtype, device=self.device,
        )
        kv_shape = (n_attn, self.num_blocks if n_attn else 0, self.block_size,
                    model.num_kv_heads, model.attn_head_dim)
        self.k_cache = torch.zeros(kv_shape, dtype=state_dtype, device=self.device)
        self.v_cache = torch.zeros(kv_shape, dtype=state_dtype, device=self.device)

    # per-layer views handed to the layers
    def conv(self, layer_idx: int) -> torch.Tensor:
        return self.conv_state[self.ssm_index[layer_idx]]

    def ssm(self, layer_idx: int) -> torch.Tensor:
        return self.ssm_state[self.ssm_index[layer_idx]]

    def kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.attn_index[layer_idx]
        return self.k_cache[i], self.v_cache[i]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.ssm_state, self.k_cache, self.v_cache))
