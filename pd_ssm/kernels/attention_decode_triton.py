"""Triton paged decode attention (flash-decoding): `attention.paged_decode_attention_ref`'s signature
and semantics, no host synchronization (the grid depends on shapes only; sequence bounds are read on
the device).

Numerics: scores are q . k accumulated in fp32 (exact products for bf16/fp16 operands), times the
scale, softmax in fp32 (online, with the running max). V is weighted by the fp32 probabilities:
with fp32 FMAs, or on tensor cores with P split into two 16-bit parts (~1e-5 relative, see
`_decode_tile`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._device import num_sms, on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.attention import _check_decode_args
from pd_ssm.kernels.launch import FastKernel


@triton.jit
def _decode_tile(q, k_cache_ptr, v_cache_ptr, table, start, hi, m_i, l_i, acc, scale, kvh,
                 num_kv_heads, head_dim, block_size,
                 USE_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Online softmax over keys [start, start + BLOCK_N) ∩ [.., hi) for the [BLOCK_G] query heads q.

    USE_DOT (q and the caches in one 16-bit dtype, BLOCK_G >= 16): tensor-core products. q . k is
    exact products summed in fp32; P.V takes P as hi + lo 16-bit parts (P - hi rounded again), so
    P keeps about 16 bits, ~1e-5 relative, far below the output's rounding. Else fp32 FMAs."""
    pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = pos < hi
    block = tl.load(table + pos // block_size, mask=n_ok, other=0)
    row = (block.to(tl.int64) * block_size + pos % block_size) * num_kv_heads + kvh  # [BLOCK_N]
    kv_off = row[:, None] * head_dim + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    kv_ok = n_ok[:, None] & (offs_d < head_dim)[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_ok, other=0.0)
    if not USE_DOT:
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_G, BLOCK_N] fp32
    elif INTERPRETED:  # NOTE: the interpreter's dot cannot take bf16 (it multiplies the raw bits)
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(n_ok[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_ok, other=0.0)
    if not USE_DOT:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    else:
        p_hi = p.to(v.dtype)
        p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
        if INTERPRETED:
            vf = v.to(tl.float32)
            pv = (tl.dot(p_hi.to(tl.float32), vf, input_precision="ieee")
                  + tl.dot(p_lo.to(tl.float32), vf, input_precision="ieee"))
        else:
            pv = tl.dot(p_lo, v, acc=tl.dot(p_hi, v))
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _decode_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, seq_lens_ptr, tables_ptr, out_ptr, part_ml_ptr, part_acc_ptr,
    # dimensions
    scale, num_kv_heads, head_dim, block_size,
    # strides
    stride_q_b, stride_q_h, stride_tables_b, stride_out_b, stride_out_h,
    # meta-parameters
    GROUP: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (sequence, kv head, split): the GROUP query heads of the kv head against one slice of
    the context. Unsplit it writes out; split, (m, l) and the unnormalized acc."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < head_dim
    heads = kvh * GROUP + offs_g  # [BLOCK_G] query heads
    qd_ok = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :], mask=qd_ok,
                other=0.0)  # [BLOCK_G, BLOCK_D]
    if not USE_DOT:
        q = q.to(tl.float32)

    seq_len = tl.load(seq_lens_ptr + b)
    # this split's slice: whole tiles, so every split but the last starts and ends on a tile edge
    per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = tables_ptr + b * stride_tables_b
    if INTERPRETED:  # the interpreter: see _INTERPRETED
        start = lo
        while start < hi:
            m_i, l_i, acc = _decode_tile(
                q, k_cache_ptr, v_cache_ptr, table, start, hi, m_i, l_i, acc, scale, kvh,
                num_kv_heads, head_dim, block_size, USE_DOT, INTERPRETED, BLOCK_N, BLOCK_D)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _decode_tile(
                q, k_cache_ptr, v_cache_ptr, table, start, hi, m_i, l_i, acc, scale, kvh,
                num_kv_heads, head_dim, block_size, USE_DOT, INTERPRETED, BLOCK_N, BLOCK_D)

    if not SPLIT:
        o = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_out_b + heads[:, None] * stride_out_h + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=qd_ok)
    else:
        # partials: ml [B, H, num_splits, 2], acc [B, H, num_splits, head_dim]; an empty split keeps
        # m = -inf, l = 0
        num_heads = num_kv_heads * GROUP
        part = (b * num_heads + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_ok)
        tl.store(part_acc_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=qd_ok)


@triton.jit
def _decode_combine_kernel(
    # pointers
    part_ml_ptr, part_acc_ptr, out_ptr,
    # dimensions
    num_heads, head_dim, num_splits,
    # strides
    stride_out_b, stride_out_h,
    # meta-parameters
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    part = (b * num_heads + h) * num_splits + offs_s  # [BLOCK_S]
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)  # finite: split 0 always holds key 0
    w = tl.where(l_s > 0.0, tl.exp(m - m_max), 0.0)  # [BLOCK_S]
    acc = tl.load(part_acc_ptr + part[:, None] * head_dim + offs_d[None, :],
                  mask=s_ok[:, None] & (offs_d < head_dim)[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(out_ptr + b * stride_out_b + h * stride_out_h + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


# NOTE: Triton 3.6's interpreter (CPU tests) cannot run `for` over tensor bounds with numpy >= 2.3
# (it calls int() on a 1-element array), so there the loops run as `while`, which compiled Triton
# does not software-pipeline: the GPU keeps `for`, and both share the tile body. Its tl.dot also
# multiplies bf16 operands as raw uint16 bits, so there they are upcast first (same products).
_INTERPRETED = not isinstance(_decode_kernel, triton.runtime.JITFunction)


class DecodeConfig(NamedTuple):
    use_dot: bool  # tensor-core products (q and caches in one 16-bit dtype); else fp32 FMAs
    block_n: int  # keys per loop step
    num_warps: int
    num_stages: int = 3


def default_decode_config(
    q_dtype: torch.dtype, cache_dtype: torch.dtype, group: int, head_dim: int
) -> DecodeConfig:
    if q_dtype == cache_dtype and q_dtype in (torch.bfloat16, torch.float16) and head_dim >= 16:
        # NOTE: best of four tilings on an H200 at 32/8 heads, head_dim 128, context 4096, batch 1 and 64
        return DecodeConfig(use_dot=True, block_n=32, num_warps=4)
    # NOTE: the fp32 path holds a [G, N, D] product at once; keep it at 8K values
    block_n = max(16, min(64, 8192 // (pow2(group) * pow2(head_dim))))
    return DecodeConfig(use_dot=False, block_n=block_n, num_warps=4)


def _num_splits(programs: int, max_tiles: int, device: torch.device) -> int:
    """Context slices per (sequence, kv head), from shapes only: enough programs for two waves over
    the SMs, at least 4 tiles of the longest possible context per slice; a power of two (<= 64)
    so that few combine kernels get compiled."""
    want = pow2(cdiv(2 * num_sms(device), programs))
    cap = 1 << (max(1, max_tiles // 4).bit_length() - 1)  # largest power of two <= max_tiles // 4
    return min(want, cap, 64)


def paged_decode_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
) -> Tensor:
    """Triton `paged_decode_attention_ref`: one new token per sequence against its paged context.

    Shapes:
      q             [B, num_heads, head_dim]   stride 1 on the last axis
      k_cache       [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
      v_cache       same as k_cache
      seq_lens      [B] int32     >= 1, including the new token, whose K/V are already in the cache
      block_tables  [B, max_blocks] int32 (entries past the sequence's last block are never read)

    Returns out [B, num_heads, head_dim] in q.dtype. No host synchronization (CUDA-graph safe):
    the context is split into slices (their number chosen from shapes only) when B * num_kv_heads
    programs would leave the GPU idle, and a second launch combines the slices.
    """
    _check_decode_args(q, k_cache, v_cache, seq_lens, block_tables)
    H, D, hkv = q.shape[1], q.shape[2], k_cache.shape[2]
    cfg = default_decode_config(q.dtype, k_cache.dtype, H // hkv, D)
    return launch_decode(q, k_cache, v_cache, seq_lens, block_tables, scale, cfg)


_DECODE = FastKernel(_decode_kernel)
_DECODE_COMBINE = FastKernel(_decode_combine_kernel)


def launch_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, block_tables: Tensor,
                  scale: float, cfg: DecodeConfig) -> Tensor:
    """The launches behind `paged_decode_attention_triton`, with the tile chosen by the caller (the
    benchmark compares them); arguments already checked."""
    B, H, D = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)  # [B, H, D]
    if B == 0:
        return out
    group = H // hkv
    block_g = pow2(group)
    block_g = max(16, block_g) if cfg.use_dot else block_g  # NOTE: tl.dot needs 16 rows; the rest are masked
    block_d = max(16, pow2(D)) if cfg.use_dot else pow2(D)
    num_splits = _num_splits(B * hkv, cdiv(block_tables.shape[1] * block_size, cfg.block_n), q.device)
    if num_splits > 1:
        part_ml = torch.empty((B, H, num_splits, 2), dtype=torch.float32, device=q.device)
        part_acc = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q.device)
    else:
        part_ml = part_acc = out  # unused
    seq_lens, tables = seq_lens.contiguous(), block_tables.contiguous()
    with on_device(q):
        _DECODE[(B, hkv, num_splits)](
            q, k_cache, v_cache, seq_lens, tables, out, part_ml, part_acc,
            float(scale), hkv, D, block_size,
            q.stride(0), q.stride(1), tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, SPLIT=num_splits > 1, USE_DOT=cfg.use_dot, INTERPRETED=_INTERPRETED,
            BLOCK_G=block_g, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if num_splits > 1:
            _DECODE_COMBINE[(B, H)](
                part_ml, part_acc, out, H, D, num_splits, out.stride(0), out.stride(1),
                BLOCK_S=num_splits, BLOCK_D=pow2(D), num_warps=4,
            )
    return out
