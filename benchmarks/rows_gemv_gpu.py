"""A multi-row GEMV on the CUDA cores (a probe, this file only) against what the decode linears take at
2-16 rows: measured, not kept (RESULTS.md session 28).

Why: at 2-16 rows the Mamba2-2.7B step runs 1.39 x its floor at batch 8 (RESULTS.md session 27), its
in_proj's 32-column DOT tile and out_proj's split GEMM + reduce being most of the excess, while the
one-row GEMV streams near the copy rate. The probe keeps the GEMV's shape for a few rows: each
program owns BLOCK_N output columns, and every step loads a slice of W once and multiplies it with
the same slice of each row of x. It lost from 4 rows on: FFMAs per weight element grow with the
rows, and at 8 rows the issue slots, not the bytes, bound it.

Layout (why the tile is 3-D): a step's slice is [LANES, BLOCK_N, VEC], VEC contiguous elements of K
(one 16-byte load at VEC 8) in each of LANES lanes. The products are summed over VEC inside each
thread, so a row's running sums are [LANES, BLOCK_N]: ROWS * BLOCK_N registers a thread in all,
not the ROWS * BLOCK_N * VEC a 2-D [BLOCK_N, BLOCK_K] accumulator per row would take. The sum over the
lanes (across threads) happens once, after the loop. A thread's x values serve all of its BLOCK_N
columns, so x's traffic through L1 is ROWS / BLOCK_N-per-thread times W's, not ROWS times.

Numerics: fp32 products and sums (another order than the DOT tile's), one rounding to the output
dtype, bias added in fp32 before it. Reference: skinny_linear_triton.skinny_linear_ref.

This times, per shape and row count, each probe tile against: the route `linear_triton` takes
(few_rows_tile's DOT tile, or cuBLAS), the 32-column DOT tile in_proj_conv uses, and cuBLAS.
Back-to-back calls in one CUDA graph, each on its own weight copy (past L2), as in
benchmarks/linear_gpu.py; each variant is checked first.

    PYTHONPATH=. [ROWS_GEMV_ROWS=2,4,8] [ROWS_GEMV_SHAPES=2.7b,...] python3 benchmarks/rows_gemv_gpu.py
    (CUDA only; JSON to $OUT/rows_gemv.json)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from benchmarks.hybrid_linear_gpu import SHAPES as ALL_SHAPES
from benchmarks.hybrid_linear_gpu import weight_copies
from benchmarks.linear_gpu import graph_time_us
from pd_ssm.kernels._device import num_sms, on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.launch import FastKernel
from pd_ssm.kernels.pdl import launch_options, pdl_gate, use_pdl
from pd_ssm.kernels.skinny_linear_triton import (
    DOT_TILE,
    few_rows_tile,
    skinny_linear_ref,
    skinny_linear_triton,
)

ROWS_MAX = 16  # the running sums are ROWS * BLOCK_N registers a thread


class RowsTile(NamedTuple):
    block_n: int  # output columns a program owns
    lanes: int  # lanes along K a step (threads, or repeats of them)
    vec: int  # contiguous K elements a lane loads a step
    num_warps: int
    num_stages: int


@triton.jit
def rows_gemv(
    x_ptr, w_ptr, offs_n, n_ok, M, stride_xm, stride_wn, K: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """The ROWS running sums, a tuple of [BLOCK_N] fp32: x[r, :] . W[offs_n, :] for r < ROWS (0 past M),
    W read once."""
    # NOTE: lanes first, VEC last: Triton's coalescing orders a load's axes by the contiguity of their
    # addresses (VEC first) and, on a tie, by axis index, so the lanes take the threads and warps and
    # each thread holds all BLOCK_N columns of its VEC elements. A row of x is loaded as [LANES, 1,
    # VEC], the same layout, so the products need no conversion; one [ROWS, ...] tile of x would
    # make a 4-D product that Triton lays out afresh, with shuffles in every step (offline sm_90).
    kk = tl.arange(0, LANES)[:, None, None] * VEC + tl.arange(0, VEC)[None, None, :]  # [LANES, 1, VEC]
    w_step = w_ptr + offs_n.to(tl.int64)[None, :, None] * stride_wn + kk  # [LANES, BLOCK_N, VEC]
    accs = ()
    for _r in tl.static_range(ROWS):
        accs = accs + (tl.zeros([LANES, BLOCK_N], dtype=tl.float32),)  # type: ignore[assignment]
    for k0 in tl.range(0, K, LANES * VEC, num_stages=NUM_STAGES):
        k_ok = (k0 + kk) < K  # [LANES, 1, VEC]; all true where LANES * VEC divides K (folded away)
        w = tl.load(w_step + k0, mask=n_ok[None, :, None] & k_ok, other=0.0).to(tl.float32)
        new = ()
        for r in tl.static_range(ROWS):
            xr = tl.load(x_ptr + r * stride_xm + k0 + kk, mask=k_ok & (r < M), other=0.0)  # [LANES, 1, VEC]
            new = new + (accs[r] + tl.sum(xr.to(tl.float32) * w, axis=2),)  # type: ignore[assignment]
        accs = new
    sums = ()
    for r in tl.static_range(ROWS):
        sums = sums + (tl.sum(accs[r], axis=0),)  # type: ignore[assignment]
    return sums


@triton.jit
def _rows_gemv_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, y_ptr,
    # dimensions (K is specialized on: a layer's K never changes, and the loop bound is static)
    M, N, K: tl.constexpr,
    # strides (the last axes have stride 1)
    stride_xm, stride_wn, stride_ym,
    # meta-parameters
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < N
    pdl_gate(PDL)  # x is the launch before's output
    sums = rows_gemv(x_ptr, w_ptr, offs_n, n_ok, M, stride_xm, stride_wn, K, ROWS, BLOCK_N, LANES, VEC,
                     NUM_STAGES)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    for r in tl.static_range(ROWS):
        y = sums[r]
        if HAS_BIAS:
            y += bias
        tl.store(y_ptr + r * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok & (r < M))


_ROWS_GEMV = FastKernel(_rows_gemv_kernel)


def rows_gemv_triton(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, tile: RowsTile) -> Tensor:
    """y [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]) for 1 <= M <= ROWS_MAX, one launch. x and
    weight share a dtype and have stride 1 on K."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"rows_gemv: x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("rows_gemv: x and weight must share a dtype and have stride 1 on K")
    M, K = x.shape
    N = weight.shape[0]
    if not 0 < M <= ROWS_MAX:
        raise ValueError(f"rows_gemv: 1..{ROWS_MAX} rows, got {M}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"rows_gemv: bias must be [{N}], got {tuple(bias.shape)}")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)  # [M, N]
    t = tile
    for name, v in (("block_n", t.block_n), ("lanes", t.lanes), ("vec", t.vec)):
        if v != pow2(v):
            raise ValueError(f"rows_gemv: a tile's {name} must be a power of two, got {v}")
    pdl = use_pdl(x)
    with on_device(x):
        _ROWS_GEMV[(cdiv(N, t.block_n),)](
            x, weight, bias, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, ROWS=pow2(M), BLOCK_N=t.block_n, LANES=t.lanes, VEC=t.vec,
            NUM_STAGES=t.num_stages, PDL=pdl, num_warps=t.num_warps, **launch_options(pdl),
        )
    return out


SHAPES = {k: v for k, v in ALL_SHAPES.items() if "lm_head" not in k}
if os.environ.get("ROWS_GEMV_SHAPES"):
    SHAPES = {k: v for k, v in SHAPES.items() if any(f in k for f in os.environ["ROWS_GEMV_SHAPES"].split(","))}
ROWS = [int(r) for r in os.environ.get("ROWS_GEMV_ROWS", "2,4,8,16").split(",")]
TILES = {f"rows bn{t.block_n} l{t.lanes} v{t.vec} w{t.num_warps} s{t.num_stages}": t for t in (
    RowsTile(4, 128, 8, 4, 4), RowsTile(8, 128, 8, 4, 4), RowsTile(2, 128, 8, 4, 4), RowsTile(4, 256, 8, 4, 3),
    RowsTile(8, 64, 8, 2, 4), RowsTile(16, 128, 8, 4, 3), RowsTile(4, 128, 8, 4, 6),
)}


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    results: list[dict[str, Any]] = []
    for name, (N, K) in SHAPES.items():
        ws = weight_copies(N, K, g)
        nbytes = N * K * 2
        for M in ROWS:
            x = torch.randn(M, K, device=dev, generator=g).bfloat16()
            ref = skinny_linear_ref(x, ws[0]).float()
            line: dict[str, Any] = {"shape": name, "rows": M, "cublas": graph_time_us(lambda xs, w: F.linear(xs, w), x, ws)}
            route = few_rows_tile(N, num_sms(dev))
            fns: dict[str, Any] = {"dot 32x128 (in_proj_conv's)": lambda xs, w: skinny_linear_triton(xs, w, tile=DOT_TILE)}
            if route is not None:
                fns["route (few_rows_tile)"] = lambda xs, w, t=route: skinny_linear_triton(xs, w, tile=t)
            for tname, t in TILES.items():
                fns[tname] = lambda xs, w, t=t: rows_gemv_triton(xs, w, tile=t)
            for fname, fn in fns.items():
                try:
                    got = fn(x, ws[0]).float()
                except Exception as e:  # a tile Triton cannot compile here: say so, time the rest
                    line[fname] = f"failed: {type(e).__name__}: {e}"[:200]
                    continue
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                if err > 2e-2:
                    line[fname] = f"wrong ({err:.2e})"
                    continue
                line[fname] = graph_time_us(fn, x, ws)
            timed = {k: v for k, v in line.items() if isinstance(v, float)}
            best_rows = min((v, k) for k, v in timed.items() if k.startswith("rows"))
            best_other = min((v, k) for k, v in timed.items() if not k.startswith("rows"))
            print(f"{name:28s} M {M:3d}  best today {best_other[1]:26s} {best_other[0]:7.1f} us "
                  f"({nbytes / best_other[0] / 1e6:4.2f} TB/s)  rows {best_rows[1]:26s} {best_rows[0]:7.1f} us "
                  f"({nbytes / best_rows[0] / 1e6:4.2f} TB/s)  x{best_other[0] / best_rows[0]:.2f}", flush=True)
            results.append(line)
    (out / "rows_gemv.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
