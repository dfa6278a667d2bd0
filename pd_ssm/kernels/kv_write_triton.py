"""Triton paged KV cache write: `attention.write_kv_cache_ref`'s signature and semantics, one launch,
no host synchronization."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import pow2
from pd_ssm.kernels.attention import _check_kv_write_args
from pd_ssm.kernels.launch import FastKernel


@triton.jit
def _write_kv_kernel(
    # pointers
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    # dimensions
    num_kv_heads, head_dim,
    # strides (the caches are contiguous: slot s, head h at (s * num_kv_heads + h) * head_dim)
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    # meta-parameters
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)  # int64
    if slot < 0:  # padding token: no cache write
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_h < num_kv_heads)[:, None] & (offs_d < head_dim)[None, :]
    dst = (slot * num_kv_heads + offs_h[:, None]) * head_dim + offs_d[None, :]  # [BLOCK_H, BLOCK_D]
    kv = tl.load(k_ptr + t * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=ok)
    tl.store(k_cache_ptr + dst, kv.to(k_cache_ptr.dtype.element_ty), mask=ok)
    kv = tl.load(v_ptr + t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=ok)
    tl.store(v_cache_ptr + dst, kv.to(v_cache_ptr.dtype.element_ty), mask=ok)


_WRITE_KV = FastKernel(_write_kv_kernel)


def write_kv_cache_triton(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Triton `write_kv_cache_ref`: k_cache/v_cache[slot_mapping[t]] <- k[t], v[t]; negative slots skipped.

    Shapes:
      k, v          [T, num_kv_heads, head_dim]   stride 1 on the last axis
      k_cache       [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
      v_cache       same as k_cache
      slot_mapping  [T] int64, block_id * block_size + offset, or < 0 to skip; distinct when >= 0
    Values are cast to the cache's dtype. One launch, no host synchronization.
    """
    _check_kv_write_args(k, v, k_cache, v_cache, slot_mapping)
    T = k.shape[0]
    _, _, hkv, d = k_cache.shape
    if T == 0:
        return
    block_h, block_d = pow2(hkv), pow2(d)
    with on_device(k):
        _WRITE_KV[(T,)](
            k, v, k_cache, v_cache, slot_mapping.contiguous(),
            hkv, d, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            BLOCK_H=block_h, BLOCK_D=block_d, num_warps=max(1, min(8, block_h * block_d // 256)),
        )

