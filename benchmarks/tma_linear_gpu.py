"""EXPERIMENT: decode-step linears with their weights loaded by the bulk tensor copy engine (TMA,
Triton tensor descriptors) against the pointer-load kernels on main and cuBLAS.

Mamba2-2.7B's in_proj [10576 x 2560] and out_proj [2560 x 5120], bf16, 64 calls in one CUDA graph
on their own weights (linear_gpu.graph_time_us), every Triton kernel under PDL (gate first).
  rows 1:  TMA GEMV (acc [BN, BK] += W * x on the CUDA cores) vs skinny_linear (FMA GEMV) vs cuBLAS
  rows 32: TMA swap-AB GEMM (W tile [BN, BK] . x^T [BK, 32] on the MMA) vs cuBLAS
Each variant's output against the fp32 reference.

    python benchmarks/tma_linear_gpu.py     (CUDA only; JSON to $OUT/tma_linear.json)
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.linear_gpu import CALLS, SHAPES, graph_time_us
from pd_ssm.kernels.pdl import pdl_gate
from pd_ssm.kernels.skinny_linear_triton import skinny_linear_ref, skinny_linear_triton


@triton.jit
def _tma_gemv(w_desc, x_ptr, y_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr):
    n0 = tl.program_id(0) * BN
    pdl_gate(True)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=NS):
        w = w_desc.load([n0, k0])  # [BN, BK]
        xv = tl.load(x_ptr + k0 + tl.arange(0, BK))  # [BK]
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    offs = n0 + tl.arange(0, BN)
    tl.store(y_ptr + offs, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=offs < N)


@triton.jit
def _tma_gemm(w_desc, x_ptr, y_ptr, M, N, K: tl.constexpr, stride_xm, stride_ym,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr):
    n0 = tl.program_id(0) * BN
    offs_m = tl.arange(0, BM)
    m_ok = offs_m < M
    x_cols = x_ptr + offs_m[None, :] * stride_xm
    pdl_gate(True)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=NS):
        w = w_desc.load([n0, k0])  # [BN, BK]
        xt = tl.load(x_cols + (k0 + tl.arange(0, BK))[:, None], mask=m_ok[None, :], other=0.0)  # [BK, BM]
        acc = tl.dot(w, xt, acc)
    offs_n = n0 + tl.arange(0, BN)
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=(offs_n < N)[:, None] & m_ok[None, :])


def tma_gemv(x: torch.Tensor, w: torch.Tensor, t: tuple[int, int, int, int]) -> torch.Tensor:
    bn, bk, warps, ns = t
    n, k = w.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    desc = TensorDescriptor.from_tensor(w, [bn, bk])
    _tma_gemv[(triton.cdiv(n, bn),)](desc, x, y, n, k, bn, bk, ns, num_warps=warps, launch_pdl=True)
    return y


def tma_gemm(x: torch.Tensor, w: torch.Tensor, t: tuple[int, int, int, int]) -> torch.Tensor:
    bn, bk, warps, ns = t
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    desc = TensorDescriptor.from_tensor(w, [bn, bk])
    _tma_gemm[(triton.cdiv(n, bn),)](desc, x, y, m, n, k, x.stride(0), y.stride(0), max(16, triton.next_power_of_2(m)),
                                     bn, bk, ns, num_warps=warps, launch_pdl=True)
    return y


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    res: list[dict[str, Any]] = []
    for (name, (n, k)), rows in itertools.product(SHAPES.items(), (1, 32)):
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05 for _ in range(CALLS)]
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        want = skinny_linear_ref(x, ws[0]).float()
        nbytes = n * k * 2
        base: dict[str, Any] = {"cublas": F.linear}
        if rows == 1:
            base["skinny (main)"] = skinny_linear_triton
        for label, fn in base.items():
            us = graph_time_us(fn, x, ws)
            res.append({"shape": name, "rows": rows, "kernel": label, "us": us})
            print(f"{name:9} rows {rows:2} {label:14}: {us:7.2f} us ({nbytes / us / 1e3:5.0f} GB/s)", flush=True)
        if rows == 1:
            tiles = list(itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 4, 6)))
            fn_t = tma_gemv
        else:
            tiles = list(itertools.product((32, 64, 128), (64, 128), (4, 8), (4, 6)))
            fn_t = tma_gemm
        best: tuple[float, Any] | None = None
        for t in tiles:
            try:
                got = fn_t(x, ws[0], t).float()
                err = ((got - want).norm() / want.norm()).item()
                us = graph_time_us(lambda a, b, t=t, f=fn_t: f(a, b, t), x, ws)
            except Exception as e:  # noqa: BLE001 -- a tile that does not fit is reported
                print(f"  {t}: {type(e).__name__}: {str(e)[:90]}", flush=True)
                continue
            res.append({"shape": name, "rows": rows, "kernel": "tma", "tile": list(t), "us": us, "rel_l2": err})
            if err > 1e-2:
                print(f"  {t}: MISMATCH rel-L2 {err:.2e}", flush=True)
            elif best is None or us < best[0]:
                best = (us, t)
            print(f"  {t}: {us:7.2f} us ({nbytes / us / 1e3:5.0f} GB/s) err {err:.1e}", flush=True)
        if best:
            print(f"{name:9} rows {rows:2} best TMA {best[1]}: {best[0]:7.2f} us ({nbytes / best[0] / 1e3:5.0f} GB/s)",
                  flush=True)
        del ws
        torch.cuda.empty_cache()
    (out / "tma_linear.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
