"""Rotary position embedding, HF convention ("rotate_half": the two halves of the rotary dims
pair up, not interleaved even/odd lanes), optionally partial (only the first `rotary_dim` dims
of each head rotate; Bamba rotates half of them).

cos/sin are computed from the absolute positions on the fly, the same way transformers does
(fp32 `position * inv_freq`, then cast to the activation dtype), so there is no table to size
for max_position_embeddings and no numeric drift against the reference.
"""

from __future__ import annotations

import torch
from torch import nn


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """[rotary_dim // 2] fp32; computed on the CPU exactly as transformers' default rope init."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim))


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, theta: float) -> None:
        super().__init__()
        if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.inv_freq: torch.Tensor  # [rotary_dim // 2] fp32
        # NOTE: fp32 and non-persistent: checkpoints do not carry it; never cast with the weights
        self.register_buffer("inv_freq", rope_inv_freq(rotary_dim, theta), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, rotary_dim] in `dtype` (broadcast over heads)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, H, head_dim]
        k: torch.Tensor,  # [T, Hkv, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return self._apply_one(q, cos, sin), self._apply_one(k, cos, sin)

    def _apply_one(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        half = rd // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        out = x_rot * cos + rotated * sin
        return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}"
