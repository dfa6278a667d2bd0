"""Triton varlen prefill attention over the paged KV cache: `attention.varlen_prefill_attention_ref`'s
signature and semantics, no host synchronization (tiles are mapped to sequences on the device).

Numerics: scores are q . k accumulated in fp32, times the scale, online softmax in fp32. P.V runs
in fp32 (`input_precision="ieee"`) unless q and the caches share one 16-bit dtype; then P is rounded
to that dtype for the tensor-core product, as flash attention does (about one ulp of a bf16 output;
fp32 P.V would make prefill FMA-bound).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.attention import _check_prefill_args
from pd_ssm.kernels.launch import FastKernel


@triton.jit
def _prefill_tile(q, q_pos, k_cache_ptr, v_cache_ptr, table, start, k_end, m_i, l_i, acc, qk_scale, kvh,
                  num_kv_heads, head_dim, block_size,
                  MASK: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Online softmax of the [BLOCK_M] queries q (at positions q_pos) over keys [start, start + BLOCK_N),
    in base 2 (qk_scale carries log2 e). MASK off: every query sees every key of the tile (keys below
    the tile's first query, all before k_end), so neither the loads nor the scores are masked."""
    pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = (offs_d < head_dim)[None, :]
    if MASK:
        n_ok = pos < k_end
        block = tl.load(table + pos // block_size, mask=n_ok, other=0)
        kv_ok = n_ok[:, None] & d_ok
    else:
        block = tl.load(table + pos // block_size)
        kv_ok = d_ok
    row = (block.to(tl.int64) * block_size + pos % block_size) * num_kv_heads + kvh
    kv_off = row[:, None] * head_dim + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_ok, other=0.0)
    if IEEE or INTERPRETED:  # NOTE: the interpreter's dot cannot take bf16 (it multiplies the raw bits)
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))  # bf16/fp16 operands: exact products, fp32 sums
    s = s * qk_scale  # [BLOCK_M, BLOCK_N], in units of log2
    if MASK:
        # every row sees key 0 in the first tile, so m_i is finite from then on
        visible = (pos[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
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
    qk_scale, num_seqs, num_kv_heads, head_dim, block_size,
    # strides
    stride_q_t, stride_q_h, stride_tables_b, stride_out_t, stride_out_h,
    # meta-parameters
    GROUP: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (query head, tile of BLOCK_M query tokens of one sequence). Program ids past the last
    tile exit at once: the grid is an upper bound computed from shapes. The grid's first programs
    take the last tiles (the most keys) of every head: the longest start first and the short ones
    fill the last wave (H200, 1 x 2048 tokens: 0.159 -> 0.144 ms)."""
    h = tl.program_id(0)
    pid = tl.program_id(1)
    kvh = h // GROUP

    # which sequence and which of its query tiles: cumulative tile counts over the sequences
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_seqs
    q_starts = tl.load(cu_q_ptr + offs_s, mask=s_ok, other=0)
    q_lens = tl.load(cu_q_ptr + offs_s + 1, mask=s_ok, other=0) - q_starts
    tiles = tl.cdiv(q_lens, BLOCK_M)  # [BLOCK_S], 0 past num_seqs
    tiles_end = tl.cumsum(tiles, axis=0)
    total = tl.max(tiles_end, axis=0)
    pid = tl.where(pid < total, total - 1 - pid, total)  # past the last tile: s comes out num_seqs
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
    # keys before `lo` (whole key tiles at or below the tile's first query, which is < seq_len) are
    # visible to every query of the tile: those tiles go without masks, the rest (the diagonal) with
    lo = ((context + m_tile * BLOCK_M + 1) // BLOCK_N) * BLOCK_N

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = tables_ptr + s.to(tl.int64) * stride_tables_b
    if INTERPRETED:  # the interpreter: see _INTERPRETED
        start = k_end * 0
        while start < lo:
            m_i, l_i, acc = _prefill_tile(
                q, q_pos, k_cache_ptr, v_cache_ptr, table, start, k_end, m_i, l_i, acc, qk_scale, kvh,
                num_kv_heads, head_dim, block_size, False, IEEE, INTERPRETED, BLOCK_N, BLOCK_D)
            start += BLOCK_N
        while start < k_end:
            m_i, l_i, acc = _prefill_tile(
                q, q_pos, k_cache_ptr, v_cache_ptr, table, start, k_end, m_i, l_i, acc, qk_scale, kvh,
                num_kv_heads, head_dim, block_size, True, IEEE, INTERPRETED, BLOCK_N, BLOCK_D)
            start += BLOCK_N
    else:
        for start in range(0, lo, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, q_pos, k_cache_ptr, v_cache_ptr, table, start, k_end, m_i, l_i, acc, qk_scale, kvh,
                num_kv_heads, head_dim, block_size, False, IEEE, INTERPRETED, BLOCK_N, BLOCK_D)
        for start in range(lo, k_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, q_pos, k_cache_ptr, v_cache_ptr, table, start, k_end, m_i, l_i, acc, qk_scale, kvh,
                num_kv_heads, head_dim, block_size, True, IEEE, INTERPRETED, BLOCK_N, BLOCK_D)

    o = acc / l_i[:, None]
    tl.store(out_ptr + tok[:, None] * stride_out_t + h * stride_out_h + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# NOTE: Triton 3.6's interpreter (CPU tests) cannot run `for` over tensor bounds with numpy >= 2.3
# (it calls int() on a 1-element array), so there the loop runs as `while`, which compiled Triton
# does not software-pipeline: the GPU keeps `for`, and both share the tile body. Its tl.dot also
# multiplies bf16 operands as raw uint16 bits, so there they are upcast first (same products).
_INTERPRETED = not isinstance(_prefill_kernel, triton.runtime.JITFunction)


_PREFILL = FastKernel(_prefill_kernel)
_LOG2E = 1.4426950408889634  # scores go to base 2: exp(x) = exp2(x log2 e)


class PrefillConfig(NamedTuple):
    use_dot: bool  # tensor-core products (q and caches in one 16-bit dtype); else IEEE fp32 dots
    block_m: int  # query tokens a program
    block_n: int  # keys a loop step
    num_warps: int
    num_stages: int = 2


def default_prefill_config(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> PrefillConfig:
    if q_dtype == cache_dtype and q_dtype in (torch.bfloat16, torch.float16):
        # NOTE: the best of eight tilings on an H200 at 32 / 8 heads of 128, pages of 16, bf16, in every
        # case of benchmarks/attention_prefill_gpu.py (1 x 2048 fresh to 1 x 2048 after 6144 tokens:
        # 239-313 TFLOP/s, 64 x 64 at 4 warps 230-273; RESULTS.md session 25)
        return PrefillConfig(use_dot=True, block_m=128, block_n=128, num_warps=8)
    # NOTE: fp32 operands hold their tiles in registers for FMA dots: smaller tiles, more warps
    return PrefillConfig(use_dot=False, block_m=32, block_n=32, num_warps=8)


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
    cfg = default_prefill_config(q.dtype, k_cache.dtype)
    return launch_prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, cfg)


def launch_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                   block_tables: Tensor, scale: float, cfg: PrefillConfig) -> Tensor:
    """The launch behind `varlen_prefill_attention_triton`, with the tile chosen by the caller (tests
    and the benchmark compare them); arguments already checked."""
    T, H, D = q.shape
    S = seq_lens.shape[0]
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)  # [T, H, D]
    if T == 0 or S == 0:
        return out
    # NOTE: sum over sequences of cdiv(len, BLOCK_M) <= cdiv(T, BLOCK_M) + S - 1
    max_tiles = cdiv(T, cfg.block_m) + S - 1
    tables = block_tables.contiguous()
    with on_device(q):
        _PREFILL[(H, max_tiles)](
            q, k_cache, v_cache, cu_seqlens_q.contiguous(), seq_lens.contiguous(), tables, out,
            float(scale) * _LOG2E, S, hkv, D, block_size,
            q.stride(0), q.stride(1), tables.stride(0), out.stride(0), out.stride(1),
            GROUP=H // hkv, IEEE=not cfg.use_dot, INTERPRETED=_INTERPRETED, BLOCK_S=pow2(S + 1),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=max(16, pow2(D)),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out
