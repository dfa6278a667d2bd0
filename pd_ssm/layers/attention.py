"""Paged multi-head / grouped-query attention over the KV block pool.

One step: project q/k/v for every token, rotate (if the model has rotary), write this step's K/V
into the pool at `slot_mapping`, then attend — decode tokens with the paged decode kernel, prefill
chunks with the varlen prefill kernel, which reads the chunk's own K/V back from the pool (it was
just written), so a chunk that continues a prompt sees its earlier chunks too.
"""

from __future__ import annotations

import torch
from torch import nn

from pd_ssm.cache.pool import CachePool
from pd_ssm.engine.forward_meta import ForwardMeta
from pd_ssm.kernels.dispatch import Kernels
from pd_ssm.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        layer_idx: int,
        kernels: Kernels,
        bias: bool = False,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.layer_idx = layer_idx
        self.kernels = kernels
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.rotary = rotary  # None: no positional embedding (NemotronH)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T] int64
        meta: ForwardMeta,
        cache: CachePool,
    ) -> torch.Tensor:  # [T, hidden]
        T = hidden.shape[0]
        lin = self.kernels.linear  # a weight-streaming GEMV at one row on the Triton kernels
        q = lin(hidden, self.q_proj.weight, self.q_proj.bias).view(T, self.num_heads, self.head_dim)
        k = lin(hidden, self.k_proj.weight, self.k_proj.bias).view(T, self.num_kv_heads, self.head_dim)
        v = lin(hidden, self.v_proj.weight, self.v_proj.bias).view(T, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)

        k_cache, v_cache = cache.kv(self.layer_idx)
        self.kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)

        nd = meta.num_decodes
        parts: list[torch.Tensor] = []
        if nd:
            dec = meta.decode_view()
            parts.append(
                self.kernels.paged_decode_attention(
                    q[:nd], k_cache, v_cache,
                    seq_lens=dec.seq_lens, block_tables=dec.block_tables, scale=self.scale,
                )
            )
        if meta.num_prefills:
            pre = meta.prefill_view()
            parts.append(
                self.kernels.varlen_prefill_attention(
                    q[nd:], k_cache, v_cache,
                    cu_seqlens_q=pre.query_start_loc, seq_lens=pre.seq_lens,
                    block_tables=pre.block_tables, scale=self.scale,
                )
            )
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # [T, H, D]
        return lin(out.reshape(T, self.num_heads * self.head_dim), self.o_proj.weight, self.o_proj.bias)
