"""Triton y = x W^T (+ bias) for the few rows of a decode step: a weight-streaming kernel.

At decode, a linear layer reads its whole weight matrix for a handful of rows: the step is bound by
the weight bytes, and what matters is keeping enough of them in flight on every SM.  cuBLAS picks
split-K kernels plus a reduction for these shapes (two launches, 2.4-3.4 TB/s measured inside the
Mamba2-2.7B decode step on an H200).  This kernel gives each program BLOCK_N output columns for all
rows and streams their K-long weight rows through a software pipeline (num_stages), no split-K.

  one row   ("FMA" path, here): acc[BLOCK_N, BLOCK_K] += W * x on the CUDA cores, reduced over K at
             the end, one row of x at a time (the tensor cores gain nothing on a memory-bound GEMV)
  more rows ("DOT" path, skinny_gemm_triton.py): tl.dot of [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]
             tiles, fp32 accumulate, K optionally split over programs

Numerics: fp32 accumulation, one rounding to the output dtype, bias added in fp32 before it.
Reference: `skinny_linear_ref` (torch.nn.functional.linear on fp32 upcasts, rounded once).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._device import num_sms
from pd_ssm.kernels._grid import cdiv
from pd_ssm.kernels.launch import FastKernel
from pd_ssm.kernels.linear import linear_ref, logits_ref
from pd_ssm.kernels.pdl import launch_options, pdl_gate, use_pdl
from pd_ssm.kernels.pending_norm import PendingNorm, check_pending_norm
from pd_ssm.kernels.skinny_gemm_triton import launch_dot, launch_split_reduce

MAX_ROWS = 256  # more rows than this: a real GEMM (cuBLAS) is the better tool


class LinearTile(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # DOT path: K split over this many programs, fp32 partials summed by a second launch
    prefetch_k: int = 0  # FMA path under PDL: weight columns loaded before waiting for x (a multiple of block_k)
    # the one-row in_proj_conv and out_proj_add kernels only: output columns a program owns (<= block_n; 0: block_n)
    cols: int = 0


# NOTE: the fastest of benchmarks/linear_gpu.py's sweep on an H200 (RESULTS.md, 2026-11-30): one row,
# in_proj [10576 x 2560] 14.7 us (3.69 TB/s, cuBLAS 15.8 us) and out_proj [2560 x 5120] 8.5 us
# (3.09 TB/s, cuBLAS 11.0 us); narrow outputs want narrower tiles (more programs than SMs)
# 32-row tiles (session 7): the batch-1 chain 30.15 against 30.72 us per layer, the engine's batch-1
# step 2.087-2.089 against 2.135-2.137 ms in one A/B call (ids-only rows level); the same K
# blocking, so the same bits
FMA_TILE = LinearTile(32, 256, 4, 3)
# NOTE: its first 2048 weight columns are loaded before the PDL gate (pdl.py), i.e. while the
# state update before out_proj still runs: 30.4-30.7 against 31.7-31.9 us per layer of the batch-1
# decode chain (benchmarks/pdl_gpu.py, H200, RESULTS.md session 6); in_proj gains nothing from it
# (its predecessor, the residual norm, is too short), and 1024 columns there left 2 programs per SM;
# nor with out_proj before it (the pending norm, session 18: 256 / 512 columns 29.8 / 30.9 against
# 28.2-28.5 us a layer, benchmarks/decode_chain_gpu.py).
# 4-row tiles: out_proj's 2560 rows make 640 programs (8 rows: 320 on 132 SMs, 3 against 2.4 a
# SM): 29.9 against 30.7-30.8 us per layer, bit-equal (session 7)
FMA_TILE_NARROW = LinearTile(4, 512, 4, 4, prefetch_k=2048)  # N <= 4096
# NOTE: at 32 and 128 rows this tile lost to cuBLAS (0.66-0.95x, too few programs without split-K;
# session 7, 32-column tiles on mma v2): `linear_triton` takes FEW_ROWS_TILE up to 32 rows (below)
# and cuBLAS past them. This one serves a pending norm's in_proj (pending_norm.py, up to 32 rows):
# the scale rides its epilogue, where the norm's launch it saves pays for what it loses to cuBLAS
# (decode batch 32 5.44 -> 5.36 ms, batch 8 3.25 -> 3.10, RESULTS.md session 18); and, split along
# K, out_proj there (out_proj_add_triton.py).
# 32 columns (mma v2), where 64 (the wgmma's M, skinny_gemm_triton.dot_cols) streamed in_proj alone
# faster at 32 rows (16.7 against 17.2-17.7 us, benchmarks/few_row_gemm_gpu.py) but lost in the
# layer chains with the conv in its epilogue (235 registers, 2 programs per SM): 8 / 16 / 32 rows
# 44.2 / 56.5 / 80.0 against 43.9 / 55.5 / 78.5 us a layer (H200, benchmarks/wide_out_proj_gpu.py,
# RESULTS.md session 20)
DOT_TILE = LinearTile(32, 128, 4, 4)
# NOTE: one row only: at 4 and 8 rows the FMA path re-reads W per row and ran 0.22-0.72x cuBLAS
FMA_MAX_ROWS = 1
# NOTE: 2-32 rows, plain linears (no pending norm, no conv epilogue): 64 columns a program, W's slice
# the wgmma's M. Against cuBLAS at 2 / 4 / 8 / 16 / 32 rows (H200, benchmarks/hybrid_linear_gpu.py,
# RESULTS.md session 27), per shape: K split in 4 where the 64-column tiles are fewer than the SMs
# (Bamba / Nemotron-H out_proj, down, q / o, k / v; the 2.7B out_proj) 1.00-1.16x; whole K where
# they are 1.5 SMs' worth or more (gate_up, up, the hybrids' in_proj) 0.98-1.20x. In between (the
# 2.7B in_proj, 166 tiles on 132 SMs: a second wave a quarter full) they ran 0.85-0.90x: cuBLAS.
# Engine A/B (Bamba-9B / Nemotron-H-8B decode): batch 2-16 -5.1 to -5.8% / -2.8 to -3.3%, batch 32
# -3.4% / -0.5%
DOT_MAX_ROWS = 32
FEW_ROWS_TILE = LinearTile(64, 128, 4, 4)
FEW_ROWS_SPLIT = 4


def skinny_linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) in fp32, rounded once to x.dtype."""
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


@triton.jit
def fma_gemv_pre(w_rows, n_ok, K: tl.constexpr, PRE_K: tl.constexpr):
    """The weights of the first PRE_K columns [BLOCK_N, PRE_K], loaded before the caller's PDL gate
    (a placeholder where PRE_K is 0)."""
    # NOTE: one return: Triton requires every return of a function to have one type, while a branch
    # on a constexpr is resolved before types are checked
    if PRE_K > 0:
        offs_pk = tl.arange(0, PRE_K)  # [PRE_K]
        w_pre = tl.load(w_rows + offs_pk[None, :], mask=n_ok[:, None] & (offs_pk < K)[None, :], other=0.0)
    else:
        w_pre = tl.zeros([1, 1], dtype=tl.float32)
    return w_pre


@triton.jit
def fma_gemv_main(
    x_row, w_pre, w_rows, n_ok, K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PRE_K: tl.constexpr,
):
    """y [BLOCK_N] fp32 = W[rows] . x over K, after the caller's gate: w_pre (fma_gemv_pre) covers the
    first PRE_K columns, the loop the rest."""
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    if PRE_K > 0:
        offs_pk = tl.arange(0, PRE_K)  # [PRE_K]
        x_pre = tl.load(x_row + offs_pk, mask=offs_pk < K, other=0.0)  # [PRE_K]
        y = tl.sum(w_pre.to(tl.float32) * x_pre.to(tl.float32)[None, :], axis=1)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(PRE_K, K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_ok = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        xv = tl.load(x_row + offs_k, mask=k_ok, other=0.0)  # [BLOCK_K]
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    return y + tl.sum(acc, axis=1)  # [BLOCK_N]


@triton.jit
def fma_gemv_row(
    x_row, w_rows, n_ok, K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr, PRE_K: tl.constexpr,
):
    """y [BLOCK_N] fp32 = W[rows] . x over K (x_row: the row's pointer, w_rows [BLOCK_N, 1] pointers).
    The PDL gate is in here: PRE_K > 0 (a multiple of BLOCK_K) loads the weights of the first PRE_K
    columns into registers before it, i.e. while the launch before this one (which writes x) still
    runs (pdl.py); a caller's loads before this call go before the gate too."""
    w_pre = fma_gemv_pre(w_rows, n_ok, K, PRE_K)
    pdl_gate(PDL)
    return fma_gemv_main(x_row, w_pre, w_rows, n_ok, K, BLOCK_N, BLOCK_K, NUM_STAGES, PRE_K)


@triton.jit
def _skinny_fma_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, y_ptr,
    # dimensions (K is specialized on: a layer's K never changes, and the loop bound is static)
    M, N, K: tl.constexpr,
    # strides (the last axes have stride 1)
    stride_xm, stride_wn, stride_ym,
    # meta-parameters
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr, PRE_K: tl.constexpr,
):
    """PRE_K: see fma_gemv_row."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1)  # one row per program along axis 1: W is re-read from L2 per row
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    y = fma_gemv_row(x_ptr + m.to(tl.int64) * stride_xm, w_rows, n_ok, K, BLOCK_N, BLOCK_K, NUM_STAGES, PDL, PRE_K)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


_SKINNY_FMA = FastKernel(_skinny_fma_kernel)


def skinny_linear_triton(
    inp: Tensor | PendingNorm, weight: Tensor, bias: Tensor | None = None, *, tile: LinearTile | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """y [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), M <= MAX_ROWS, one launch; into `out`
    [M, N] where given, in x's dtype or fp32 (the fp32 sums stored unrounded: the logits).

    x and weight share a dtype (bf16 / fp16 / fp32) and have stride 1 on K; bias in any float
    dtype.  fp32 inputs take IEEE fp32 dots (never tf32), as torch's default linear does.
    The input may be a pending norm (pending_norm.py: `linear_pending_ref`'s arithmetic) on the
    DOT path (more than FMA_MAX_ROWS rows, no split of K).
    """
    pending = inp if isinstance(inp, PendingNorm) else None
    if pending is not None:
        check_pending_norm("skinny_linear", pending)
    x = inp.x if isinstance(inp, PendingNorm) else inp
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_linear: x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_linear: x and weight must share a dtype and have stride 1 on K")
    M, K = x.shape
    N = weight.shape[0]
    if not 0 < M <= MAX_ROWS:
        raise ValueError(f"skinny_linear: 1..{MAX_ROWS} rows, got {M}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"skinny_linear: bias must be [{N}], got {tuple(bias.shape)}")
    if out is None:
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)  # [M, N]
    elif out.shape != (M, N) or out.dtype not in (x.dtype, torch.float32) or out.stride(1) != 1 \
            or out.device != x.device:
        raise ValueError(f"skinny_linear: out must be [{M}, {N}] in {x.dtype} or float32 with stride 1 on N, on "
                         f"{x.device}; got {tuple(out.shape)} {out.dtype} stride {out.stride()} on {out.device}")
    else:
        y = out
    t = tile or (fma_tile(N) if M <= FMA_MAX_ROWS else DOT_TILE)
    if t.cols:
        raise ValueError(f"skinny_linear: cols is the one-row in_proj_conv / out_proj_add kernels' knob, got {t.cols}")
    if pending is not None and (M <= FMA_MAX_ROWS or t.split_k > 1):
        raise ValueError(f"skinny_linear: a pending norm takes the DOT path without a split of K ({M} rows, "
                         f"split {t.split_k}); one row goes through in_proj_conv")
    if M <= FMA_MAX_ROWS:
        pdl = use_pdl(x)
        if t.prefetch_k % t.block_k or t.prefetch_k & (t.prefetch_k - 1):
            raise ValueError(f"skinny_linear: prefetch_k must be 0 or a power of two multiple of block_k "
                             f"({t.block_k}), got {t.prefetch_k}")
        _SKINNY_FMA[(cdiv(N, t.block_n), M)](
            x, weight, bias, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=t.block_n, BLOCK_K=t.block_k, NUM_STAGES=t.num_stages,
            PDL=pdl, PRE_K=t.prefetch_k, num_warps=t.num_warps, **launch_options(pdl),
        )
    else:
        split = max(1, t.split_k)
        # NOTE: fp32 partials [split, M, N]: a second launch sums them in a fixed order
        dst = y if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        launch_dot(x, weight, dst, t, bias=bias, pending=pending)
        if split > 1:
            launch_split_reduce(dst, bias, y)
    return y


def tile_cols(t: LinearTile) -> int:
    """The output columns a program of a one-row kernel owns under tile t (LinearTile.cols)."""
    if not 0 <= t.cols <= t.block_n:
        raise ValueError(f"a tile's cols must be 0 (block_n) or at most block_n ({t.block_n}), got {t.cols}")
    return t.cols or t.block_n


def balanced(t: LinearTile, n: int, sms: int) -> LinearTile:
    """t with fewer columns a program (LinearTile.cols) where that makes the grid an even number of
    programs on every SM: as many a SM as t's full tiles would take. in_proj at one row, 2.7B shape on
    the H200 (132 SMs): 331 programs of 32 columns (2 or 3 a SM) -> 392 of 27 (3 a SM), the engine's
    batch-1 step 1.865-1.873 -> 1.787-1.788 ms, the layer chain 26.88 / 27.92 against 27.15 /
    28.62-28.71 us a layer (RESULTS.md session 22); 21 columns (4 a SM) 31.9-32.6, 41 of 64 (2 a SM)
    29.2-30.4. The same cut lost for out_proj's one-row tiles and in_proj's DOT tile (session 22)."""
    per_sm = cdiv(cdiv(n, t.block_n), sms)
    return t._replace(cols=min(t.block_n, cdiv(n, per_sm * sms)))


def fma_tile(n: int) -> LinearTile:
    """The one-row GEMV's tile for an output of `n` columns (narrow outputs want narrower tiles)."""
    return FMA_TILE_NARROW if n <= 4096 else FMA_TILE


def _streams(x: Tensor, weight: Tensor, max_rows: int) -> bool:
    """bf16 / fp16 on CUDA, 1..max_rows rows, stride 1 on K: where the weight-streaming kernels were
    measured against cuBLAS."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= max_rows and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(1) == 1 and weight.stride(1) == 1)


def gemv_serves(x: Tensor, weight: Tensor) -> bool:
    """Whether the weight-streaming GEMV is the faster choice for x @ weight^T: bf16 / fp16 on CUDA,
    at most FMA_MAX_ROWS rows (decode steps of small batches), stride 1 on K."""
    return _streams(x, weight, FMA_MAX_ROWS)


def few_rows_tile(n: int, sms: int) -> LinearTile | None:
    """The DOT path's tile for a linear of `n` output columns at 2..DOT_MAX_ROWS rows on `sms` SMs, or
    None where cuBLAS was the faster (the NOTE at DOT_MAX_ROWS)."""
    tiles = cdiv(n, FEW_ROWS_TILE.block_n)
    if tiles < sms:
        return FEW_ROWS_TILE._replace(split_k=FEW_ROWS_SPLIT)
    if 2 * tiles >= 3 * sms:
        return FEW_ROWS_TILE
    return None


def streaming_tile(x: Tensor, weight: Tensor) -> LinearTile | None:
    """The tile of the weight-streaming kernel that takes x @ weight^T on the Triton backend: the GEMV
    at one row, the DOT path at 2..DOT_MAX_ROWS rows where `few_rows_tile` has one (bf16 / fp16 on
    CUDA: decode steps of small batches); None for cuBLAS."""
    if not _streams(x, weight, DOT_MAX_ROWS):
        return None
    if x.shape[0] <= FMA_MAX_ROWS:
        return fma_tile(weight.shape[0])
    return few_rows_tile(weight.shape[0], num_sms(x.device))


def linear_triton(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The model's linear layers on the Triton backend: the weight-streaming kernels where they were
    measured faster than cuBLAS (`streaming_tile`), torch's F.linear (cuBLAS) everywhere else.
    x [M, K], weight [N, K]."""
    tile = streaming_tile(x, weight)
    if tile is not None:
        return skinny_linear_triton(x, weight, bias, tile=tile)
    return linear_ref(x, weight, bias)


def logits_triton(hidden: Tensor, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """The lm_head's fp32 logits on the Triton backend (`logits_ref`'s contract): the weight-streaming
    kernels store their fp32 sums as cuBLAS's fp32-output launch does, where `streaming_tile` has a
    tile; `logits_ref` elsewhere."""
    # NOTE: graph-timed over weight copies past L2 (H200, benchmarks/hybrid_linear_gpu.py, RESULTS.md
    # session 27), against torch.mm(out_dtype=fp32): the 2.7B lm_head [50288 x 2560] 66.6 -> 59.7 us at
    # one row (4.32 TB/s), 1.07-1.10x at 2-32 rows; Bamba's [128256 x 4096] 274 -> 234 us, 1.04-1.09x
    tile = streaming_tile(hidden, weight)
    if tile is None:
        return logits_ref(hidden, weight, out)
    if out is None:
        out = torch.empty((hidden.shape[0], weight.shape[0]), dtype=torch.float32, device=hidden.device)
    return skinny_linear_triton(hidden, weight, tile=tile, out=out)
