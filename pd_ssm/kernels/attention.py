"""Paged KV cache: writing new K/V into blocks, and causal attention reading from them.

KV pools: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]. The token at
position p of a sequence lives in block block_table[p // block_size] at offset p % block_size,
i.e. at flat slot block_id * block_size + offset.

GQA: query head h reads kv head h // (num_heads // num_kv_heads). Scores, softmax and the
weighted sum of V run in fp32; outputs are in the dtype of q.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pd_ssm.kernels._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_offsets,
    check_same_device,
    check_shape,
)

_CACHE_DIMS = "[num_blocks, block_size, num_kv_heads, head_dim]"


def _check_caches(k: str, k_cache: Tensor, v_cache: Tensor) -> None:
    check_ndim(k, "k_cache", k_cache, _CACHE_DIMS)
    check_shape(k, "v_cache", v_cache, _CACHE_DIMS, tuple(k_cache.shape))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(k, name, t, FLOAT_DTYPES)
        check_contiguous(k, name, t)


def _check_kv_write_args(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """write_kv_cache's argument checks, shared by the reference and the Triton launcher."""
    name = "write_kv_cache"
    _check_caches(name, k_cache, v_cache)
    _, _, hkv, d = k_cache.shape
    check_ndim(name, "k", k, "[T, num_kv_heads, head_dim]")
    T = k.shape[0]
    check_shape(name, "k", k, "[T, num_kv_heads, head_dim]", (T, hkv, d))
    check_shape(name, "v", v, "[T, num_kv_heads, head_dim]", (T, hkv, d))
    check_shape(name, "slot_mapping", slot_mapping, "[T]", (T,))
    check_dtype(name, "k", k, FLOAT_DTYPES)
    check_dtype(name, "v", v, FLOAT_DTYPES)
    check_dtype(name, "slot_mapping", slot_mapping, (torch.int64,))
    check_last_dim_contiguous(name, "k", k)
    check_last_dim_contiguous(name, "v", v)
    check_same_device(name, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def write_kv_cache_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """k_cache/v_cache[slot_mapping[t]] <- k[t], v[t], in place; tokens with a negative slot are skipped.

    Shapes:
      k, v          [T, num_kv_heads, head_dim]   stride 1 on the last axis
      k_cache       [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
      v_cache       same as k_cache
      slot_mapping  [T] int64, block_id * block_size + offset, or < 0 to skip; distinct when >= 0
    Values are cast to the cache's dtype.
    """
    _check_kv_write_args(k, v, k_cache, v_cache, slot_mapping)
    _, _, hkv, d = k_cache.shape
    keep = slot_mapping >= 0  # [T]
    slots = slot_mapping[keep]  # [T'] (boolean indexing: a host sync, fine for the reference)
    k_cache.view(-1, hkv, d).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def _check_attention_args(
    k: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, block_tables: Tensor
) -> None:
    _check_caches(k, k_cache, v_cache)
    check_ndim(k, "q", q, "[T, num_heads, head_dim]")
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    H = q.shape[1]
    check_shape(k, "q", q, "[T, num_heads, head_dim]", (q.shape[0], H, d))
    if hkv == 0 or H % hkv != 0:
        raise ValueError(f"{k}: num_heads ({H}) must be a multiple of num_kv_heads ({hkv})")
    S = seq_lens.shape[0]
    check_ndim(k, "seq_lens", seq_lens, "[S]")
    check_ndim(k, "block_tables", block_tables, "[S, max_blocks]")
    check_shape(k, "block_tables", block_tables, "[S, max_blocks]", (S, block_tables.shape[1]))
    check_dtype(k, "q", q, FLOAT_DTYPES)
    check_dtype(k, "seq_lens", seq_lens, (torch.int32,))
    check_dtype(k, "block_tables", block_tables, (torch.int32,))
    check_last_dim_contiguous(k, "q", q)
    check_same_device(k, q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_tables=block_tables)


def _check_prefill_args(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor, block_tables: Tensor
) -> None:
    """varlen_prefill_attention's argument checks (shapes, dtypes, devices; not the offsets' values),
    shared by the reference and the Triton launcher."""
    k = "varlen_prefill_attention"
    _check_attention_args(k, q, k_cache, v_cache, seq_lens, block_tables)
    check_shape(k, "cu_seqlens_q", cu_seqlens_q, "[S+1]", (seq_lens.shape[0] + 1,))
    check_dtype(k, "cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    check_same_device(k, q=q, cu_seqlens_q=cu_seqlens_q)


def _check_decode_args(q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, block_tables: Tensor) -> None:
    """paged_decode_attention's argument checks, shared by the reference and the Triton launcher."""
    k = "paged_decode_attention"
    _check_attention_args(k, q, k_cache, v_cache, seq_lens, block_tables)
    check_shape(k, "q", q, "[B, num_heads, head_dim]", (seq_lens.shape[0], q.shape[1], q.shape[2]))


def _attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """q [..., H, Lq, D] against keys/values [..., H, Lk, D]; mask [..., 1 or H, Lq, Lk] True = attend."""
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale  # [..., H, Lq, Lk]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, values.float())  # [..., H, Lq, D] fp32


def varlen_prefill_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
) -> Tensor:
    """Causal attention of S prefill chunks over their whole paged context.

    Shapes:
      q             [T, num_heads, head_dim]   stride 1 on the last axis
      k_cache       [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
      v_cache       same as k_cache
      cu_seqlens_q  [S+1] int32   query token offsets; every sequence has >= 1 query token
      seq_lens      [S] int32     context + this chunk; this chunk's K/V are ALREADY in the cache
      block_tables  [S, max_blocks] int32

    Query i of sequence s sits at absolute position seq_len - q_len + i and attends to keys at
    positions 0..that position. Returns out [T, num_heads, head_dim] in q.dtype.
    Reads cu_seqlens_q and seq_lens on the host (one device sync); the Triton kernel does not.
    """
    k = "varlen_prefill_attention"
    _check_prefill_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables)
    T, H, D = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    cu: list[int] = cu_seqlens_q.tolist()
    lens: list[int] = seq_lens.tolist()
    check_offsets(k, "cu_seqlens_q", cu, T)
    for s, n in enumerate(lens):
        if n < cu[s + 1] - cu[s] or n > block_tables.shape[1] * block_size:
            raise ValueError(f"{k}: seq_lens[{s}]={n} must cover its {cu[s + 1] - cu[s]} query tokens "
                             f"and fit in {block_tables.shape[1]} blocks of {block_size}")

    k_flat = k_cache.view(-1, hkv, D)  # [num_slots, Hkv, D]
    v_flat = v_cache.view(-1, hkv, D)  # [num_slots, Hkv, D]
    out = torch.empty_like(q)  # [T, H, D]
    for s, n in enumerate(lens):
        q_len = cu[s + 1] - cu[s]
        pos = torch.arange(n, device=q.device)  # [n] key positions
        slots = block_tables[s].long()[pos // block_size] * block_size + pos % block_size  # [n]
        # GQA: each kv head serves H // Hkv consecutive query heads
        keys = k_flat[slots].repeat_interleave(H // hkv, dim=1).transpose(0, 1)  # [H, n, D]
        values = v_flat[slots].repeat_interleave(H // hkv, dim=1).transpose(0, 1)  # [H, n, D]
        q_pos = torch.arange(n - q_len, n, device=q.device)  # [q_len] absolute query positions
        causal = pos[None, :] <= q_pos[:, None]  # [q_len, n]
        o = _attend(q[cu[s]:cu[s + 1]].transpose(0, 1), keys, values, causal[None], scale)  # [H, q_len, D]
        out[cu[s]:cu[s + 1]] = o.transpose(0, 1).to(q.dtype)
    return out


def paged_decode_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
) -> Tensor:
    """Attention of one new token per sequence (at position seq_len - 1) over its paged context.

    Shapes:
      q             [B, num_heads, head_dim]   stride 1 on the last axis
      k_cache       [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
      v_cache       same as k_cache
      seq_lens      [B] int32     >= 1, including the new token, whose K/V are already in the cache
      block_tables  [B, max_blocks] int32 (entries past the sequence's last block are ignored)

    Returns out [B, num_heads, head_dim] in q.dtype. No host synchronization: every table entry is
    gathered and positions >= seq_len are masked.
    """
    _check_decode_args(q, k_cache, v_cache, seq_lens, block_tables)
    B, H, D = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    n_max = block_tables.shape[1] * block_size
    tables = block_tables.long()  # [B, max_blocks]
    keys = k_cache[tables].reshape(B, n_max, hkv, D).repeat_interleave(H // hkv, dim=2)  # [B, n_max, H, D]
    values = v_cache[tables].reshape(B, n_max, hkv, D).repeat_interleave(H // hkv, dim=2)  # [B, n_max, H, D]
    visible = torch.arange(n_max, device=q.device)[None, :] < seq_lens[:, None]  # [B, n_max]
    o = _attend(q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                visible[:, None, None, :], scale)  # [B, H, 1, D]
    return o[:, :, 0, :].to(q.dtype)
