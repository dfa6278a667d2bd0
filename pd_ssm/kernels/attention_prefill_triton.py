"""Triton varlen prefill attention over the paged KV cache: `attention.varlen_prefill_attention_ref`'s
signature and semantics, no host synchronization (tiles are mapped to sequences on the device).

Numerics: scores are q . k accumulated in fp32, times the scale, online softmax in fp32. P.V runs
in fp32 (`input_precision="ieee"`) unless q and the caches share one 16-bit dtype; then P is rounded
to that dtype for the tensor-core product, as flash attention does (about one ulp of a bf16 output;
fp32 P.V would make prefill FMA-bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.attention import _check_prefill_args
from pd_ssm.kernels.launch import FastKernel


@triton.jit
def _prefill_tile(q, q_pos, k_cache_ptr, v_cache_ptr, table, start, k_end, m_i, l_i, acc, scale, kvh,
                  num_kv_heads, head_dim, block_size,
                  IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Online softmax of the [BLOCK_M] queries q (at positions q_pos) over keys [start, start + BLOCK_N)."""
    pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = pos < k_end
    block = tl.load(table + pos // block_size, mask=n_ok, other=0)
    row = (block.to(tl.int64) * block_size + pos % block_size) * num_kv_heads + kvh
    kv_off = row[:, None] * head_dim + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    kv_ok = n_ok[:, None] & (offs_d < head_dim)[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_ok, other=0.0)
    if IEEE or INTERPRETED:  # NOTE: the interpreter's dot cannot take bf16 (it multiplies the raw bits)
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))  # bf16/fp16 operands: exact products, fp32 sums
    s = s * scale  # [BLOCK_M, BLOCK_N]
    # every row sees key 0 in the first tile, so m_i is finite from then on
    visible = (pos[None, :] <= q_pos[:, None]) & n_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_ok, other=0.0)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    elif INTERPRETED:  # the same products as the tensor cores': P rounded to v.dtype, exact in fp32
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _prefill_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, cu_q_ptr, seq_lens_ptr, tables_ptr, out_ptr,
    # dimensions
    scale, num_seqs, num_kv_heads, head_dim, block_size,
    # strides
    stride_q_t, stride_q_h, stride_tables_b, stride_out_t, stride_out_h,
    # meta-parameters
    GROUP: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (tile of BLOCK_M query tokens of one sequence, query head). Program ids past the last
    tile exit at once: the grid is an upper bound computed from shapes."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP

    # which sequence and which of its query tiles: cumulative tile counts over the sequences
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_seqs
    q_starts = tl.load(cu_q_ptr + offs_s, mask=s_ok, other=0)
    q_lens = tl.load(cu_q_ptr + offs_s + 1, mask=s_ok, other=0) - q_starts
    tiles = tl.cdiv(q_lens, BLOCK_M)  # [BLOCK_S], 0 past num_seqs
    tiles_end = tl.cumsum(tiles, axis=0)
    s = tl.sum((tiles_end <= pid).to(tl.int32), axis=0)
    if s >= num_seqs:
        return
    this = offs_s == s
    m_tile = pid - tl.sum(tl.where(this, tiles_end - tiles, 0), axis=0)
    q_start = tl.sum(tl.where(this, q_starts, 0), axis=0)
    q_len = tl.sum(tl.where(this, q_lens, 0), axis=0)
    seq_len = tl.load(seq_lens_ptr + s)
    context = seq_len - q_len  # tokens of earlier chunks, already in the cache

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in this chunk
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < q_len
    d_ok = offs_d < head_dim
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_q_t + h * stride_q_h + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if IEEE:
        q = q.to(tl.float32)
    q_pos = context + offs_m  # [BLOCK_M] absolute positions
    k_end = tl.minimum(seq_len, context + (m_tile + 1) * BLOCK_M)  # keys past the tile's last query: none

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = tables_ptr + s.to(tl.int64) * stride_tables_b
    if INTERPRETED:  # the interpreter: see _INTERPRETED
        start = k_end * 0
        while start < k_end:
            m_i, l_i, acc = _prefill_tile(
                q, q_pos, k_cache_ptr, v_cache_ptr, table, start, k_end, m_i, l_i, acc, scale, kvh,
                num_kv_heads, head_dim, block_size, IEEE, INTERPRETED, BLOCK_N, BLOCK_D)
            start += BLOCK_N
    else:
        for start in range(0, k_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, q_pos, k_cache_ptr, v_cache_ptr, table, start, k_end, m_i, l_i, acc, scale, kvh,
                num_kv_heads, head_dim, block_size, IEEE, INTERPRETED, BLOCK_N, BLOCK_D)

    o = acc / l_i[:, None]
    tl.store(out_ptr + tok[:, None] * stride_out_t + h * stride_out_h + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# NOTE: Triton 3.6's interpreter (CPU tests) cannot run `for` over tensor bounds with numpy >= 2.3
# (it calls int() on a 1-element array), so there the loop runs as `while`, which compiled Triton
# does not software-pipeline: the GPU keeps `for`, and both share the tile body. Its tl.dot also
# multiplies bf16 operands as raw uint16 bits, so there they are upcast first (same products).
_INTERPRETED = not isinstance(_prefill_kernel, triton.runtime.JITFunction)


_PREFILL = FastKernel(_prefill_kernel)


def varlen_prefill_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
) -> Tensor:
    """Triton `varlen_prefill_attention_ref`: causal attention of S prefill chunks over their paged context.

    Shapes:
      q             [T, num_heads, head_dim]   stride 1 on the last axis
      k_cache       [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
      v_cache       same as k_cache
      cu_seqlens_q  [S+1] int32   query token offsets; every sequence has >= 1 query token
      seq_lens      [S] int32     context + this chunk; this chunk's K/V are ALREADY in the cache
      block_tables  [S, max_blocks] int32

    Query i of sequence s sits at absolute position seq_len - q_len + i. Returns out
    [T, num_heads, head_dim] in q.dtype. No host synchronization: cu_seqlens_q and seq_lens are
    trusted, not checked (the reference checks them on the host).
    """
    _check_prefill_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables)
    T, H, D = q.shape
    S = seq_lens.shape[0]
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)  # [T, H, D]
    if T == 0 or S == 0:
        return out
    # NOTE: tensor-core products only for one 16-bit dtype throughout; anything else runs in fp32
    ieee = not (q.dtype == k_cache.dtype and q.dtype in (torch.bfloat16, torch.float16))
    block_m, block_n, warps = (32, 32, 8) if ieee else (64, 64, 4)
    # NOTE: sum over sequences of cdiv(len, BLOCK_M) <= cdiv(T, BLOCK_M) + S - 1
    max_tiles = cdiv(T, block_m) + S - 1
    tables = block_tables.contiguous()
    with on_device(q):
        _PREFILL[(max_tiles, H)](
            q, k_cache, v_cache, cu_seqlens_q.contiguous(), seq_lens.contiguous(), tables, out,
            float(scale), S, hkv, D, block_size,
            q.stride(0), q.stride(1), tables.stride(0), out.stride(0), out.stride(1),
            GROUP=H // hkv, IEEE=ieee, INTERPRETED=_INTERPRETED, BLOCK_S=pow2(S + 1),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, pow2(D)),
            num_warps=warps, num_stages=2,
        )
    return out
