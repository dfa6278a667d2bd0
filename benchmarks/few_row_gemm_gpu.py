"""The few-row GEMMs alone: why the DOT path streams in_proj's and out_proj's weights at ~2.35 TB/s at
32 rows where the one-row GEMVs reach ~3.3 (RESULTS.md, session 19, call 12), and which tile shape
would do better.

A probe kernel (this file only) computes x W^T for M rows in three layouts:
- "plain": a [rows, columns] tile (mma v2 below 64 rows), the DOT path's until session 20;
- "swap": the transposed tile, W's [columns, K] slice as the dot's first operand (64 or 128 columns:
  the wgmma's M on sm_90) and x^T as its N, the output stored transposed (skinny_gemm_triton.py's
  `dot_cols` since session 20);
- "swap tma": the same with W's tiles through a TMA descriptor.
Each program covers N_PER columns of a BLOCK_N tile (the rest masked: no bytes loaded), so the
number of programs can be set to a multiple of the SMs' slots (the grid's balance), and K may be
split (fp32 partials; their reduce is not timed here). Beside them: the DOT path itself
(skinny_gemm_triton.launch_dot, with DOT_TILE), the one-row GEMV, and a device copy of the same bytes.

Timing: FEW_COPIES copies of each weight (past L2) in one CUDA graph, median of 7 replays, µs a
call and the weights' TB/s. Each probe's output is checked against torch's fp32 product.

    PYTHONPATH=. python3 benchmarks/few_row_gemm_gpu.py           (CUDA only; JSON to $OUT/few_row_gemm.json)
    FEW_ROWS=16,32 FEW_ONLY="<name>;<name>" ...                    (rows; a ";"-separated subset of probes)
    FEW_NCU=1 ncu ... python3 benchmarks/few_row_gemm_gpu.py       (each probe launched twice, eagerly, for ncu)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.decode_layers import D_INNER, HID, PROJ
from benchmarks.linear_gpu import graph_time_us
from pd_ssm.kernels.skinny_gemm_triton import launch_dot
from pd_ssm.kernels.skinny_linear_triton import DOT_TILE, skinny_linear_triton

SMS = 132


@triton.jit
def _probe_kernel(
    x_ptr, w_ptr, w_desc, y_ptr,
    M, N, K: tl.constexpr, stride_xm, stride_wn,
    N_PER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, SWAP: tl.constexpr,
    TMA: tl.constexpr,
):
    """y = x W^T over columns [pid_n * N_PER, + N_PER) and K slice pid_s: bf16 when SPLIT == 1, else
    fp32 partials [SPLIT, M, N]."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    cols = tl.arange(0, BLOCK_N)
    n0 = pid_n * N_PER
    offs_n = n0 + cols
    n_ok = (cols < N_PER) & (offs_n < N)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    k_first = pid_s * K_PER_SPLIT
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k_first + k0 + tl.arange(0, BLOCK_K)
        if SWAP:
            if TMA:
                w = w_desc.load([n0, k_first + k0])  # [BLOCK_N, BLOCK_K]
            else:
                w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None],
                            other=0.0)  # [BLOCK_N, BLOCK_K]
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=m_ok[None, :],
                         other=0.0)  # [BLOCK_K, BLOCK_M]
            acc = tl.dot(w, xt, acc)
        else:
            xv = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None],
                         other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None], mask=n_ok[None, :],
                        other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(xv, w, acc)
    base = y_ptr + pid_s * M * N
    if SWAP:
        tl.store(base + offs_m[None, :] * N + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=n_ok[:, None] & m_ok[None, :])
    else:
        tl.store(base + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


class Probe(NamedTuple):
    kind: str  # "plain" / "swap" / "swap tma" / "dot" (launch_dot) / "gemv" (one row) / "copy"
    block_n: int = 32
    programs: int = 0  # column programs; 0: one per BLOCK_N columns
    block_k: int = 128
    stages: int = 4
    split: int = 1
    warps: int = 4


# (shape name, probe name) -> probe; shapes: in_proj [PROJ, HID], out_proj [HID, D_INNER]
PROBES: dict[tuple[str, str], Probe] = {
    ("in", "copy"): Probe("copy"),
    ("in", "gemv (1 row)"): Probe("gemv"),
    ("in", "DOT default 32x128 s4"): Probe("dot"),
    ("in", "plain 32 cols (331 programs)"): Probe("plain"),
    ("in", "plain 27 of 32 cols (396 = 3/SM)"): Probe("plain", programs=3 * SMS),
    ("in", "plain 64 cols"): Probe("plain", block_n=64, stages=3),
    ("in", "plain 41 of 64 cols (2/SM)"): Probe("plain", block_n=64, programs=2 * SMS - 6, stages=3),
    ("in", "swap 64 s4"): Probe("swap", block_n=64),
    ("in", "swap 64 s3"): Probe("swap", block_n=64, stages=3),
    ("in", "swap 41 of 64 (2/SM) s4"): Probe("swap", block_n=64, programs=2 * SMS - 6),
    ("in", "swap 27 of 64 (3/SM) s3"): Probe("swap", block_n=64, programs=3 * SMS, stages=3),
    ("in", "swap 128 k64 s6 (1/SM)"): Probe("swap", block_n=128, programs=SMS - 1, block_k=64, stages=6),
    ("in", "swap 128 k128 s4 (1/SM)"): Probe("swap", block_n=128, programs=SMS - 1, stages=4),
    ("in", "swap 64 split 2"): Probe("swap", block_n=64, split=2),
    ("in", "swap tma 64 s4"): Probe("swap tma", block_n=64),
    ("in", "swap tma 64 k64 s6"): Probe("swap tma", block_n=64, block_k=64, stages=6),
    ("in", "swap tma 128 k64 s6"): Probe("swap tma", block_n=128, block_k=64, stages=6),
    ("out", "copy"): Probe("copy"),
    ("out", "gemv (1 row)"): Probe("gemv"),
    ("out", "DOT default 32x128 split 4"): Probe("dot", split=4),
    ("out", "plain 32 split 4"): Probe("plain", split=4),
    ("out", "plain 26 of 32 split 4 (3/SM)"): Probe("plain", programs=99, split=4),
    ("out", "swap 64 split 4"): Probe("swap", block_n=64, split=4),
    ("out", "swap 39 of 64 split 4 (2/SM)"): Probe("swap", block_n=64, programs=66, split=4),
    ("out", "swap 128 split 4 (160 -> 1/SM)"): Probe("swap", block_n=128, programs=33, split=4),
    ("out", "swap tma 64 split 4"): Probe("swap tma", block_n=64, split=4),
    ("out", "swap tma 64 k64 s6 split 4"): Probe("swap tma", block_n=64, block_k=64, stages=6, split=4),
}
SHAPES = {"in": (PROJ, HID), "out": (HID, D_INNER)}


class Setup(NamedTuple):
    x: torch.Tensor
    ws: list[torch.Tensor]
    y: torch.Tensor
    dst: torch.Tensor  # a copy's destination, a weight's size


def launch(p: Probe, s: Setup, w: torch.Tensor) -> Any:
    """One call of probe p on weight w (s.x's rows; s.y the output or partials); the compiled kernel."""
    x, y = s.x, s.y
    M, K = x.shape
    N = w.shape[0]
    if p.kind == "copy":
        s.dst.copy_(w)
        return None
    if p.kind == "gemv":
        skinny_linear_triton(x[:1], w)
        return None
    if p.kind == "dot":
        launch_dot(x, w, y if p.split > 1 else y[0], DOT_TILE._replace(split_k=p.split))
        return None
    n_per = triton.cdiv(N, p.programs) if p.programs else p.block_n
    k_per = K // p.split
    tma = p.kind == "swap tma"
    desc = None
    if tma:
        desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [p.block_n, p.block_k])
    out = y if p.split > 1 else y[0]
    return _probe_kernel[(triton.cdiv(N, n_per), p.split)](
        x, w, desc, out, M, N, K, x.stride(0), w.stride(0),
        N_PER=n_per, BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=p.block_n, BLOCK_K=p.block_k,
        K_PER_SPLIT=k_per, SPLIT=p.split, NUM_STAGES=p.stages, SWAP=p.kind != "plain", TMA=tma,
        num_warps=p.warps, num_stages=p.stages,
    )


def check(p: Probe, s: Setup) -> float:
    """Relative difference of the probe's output from torch's fp32 x W^T (nan: nothing to check)."""
    if p.kind in ("copy", "gemv"):
        return float("nan")
    w = s.ws[0]
    s.y.zero_()
    launch(p, s, w)
    got = s.y.float().sum(0) if p.split > 1 else s.y[0].float()
    want = s.x.float() @ w.float().t()
    return float((got - want).norm() / want.norm())


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    only = [n for n in os.environ.get("FEW_ONLY", "").split(";") if n]
    ncu = os.environ.get("FEW_NCU") == "1"
    copies = int(os.environ.get("FEW_COPIES", "16"))
    results: list[dict[str, Any]] = []
    for rows in (int(r) for r in os.environ.get("FEW_ROWS", "32").split(",")):
        for shape, (N, K) in SHAPES.items():
            ws = [(torch.randn(N, K, device=dev) * K ** -0.5).to(torch.bfloat16) for _ in range(2 if ncu else copies)]
            x = torch.randn(rows, K, device=dev).to(torch.bfloat16)
            y = torch.empty(4, rows, N, device=dev)  # room for a split of 4, or a weight's copy
            ybf = torch.empty(1, rows, N, device=dev, dtype=torch.bfloat16)
            dst = torch.empty_like(ws[0])
            for rnd in range(1 if ncu else 2):
                for (sh, name), p in PROBES.items():
                    if sh != shape or (only and name not in only):
                        continue
                    s = Setup(x, ws, y if p.split > 1 else ybf, dst)
                    try:
                        rel = check(p, s) if rnd == 0 else float("nan")
                        if ncu:
                            for w in ws:
                                launch(p, s, w)
                            torch.cuda.synchronize()
                            continue
                        us = graph_time_us(lambda s_, w, p=p: launch(p, s_, w), s, ws)
                        k = launch(p, s, ws[0])
                    except Exception as e:  # noqa: BLE001 -- a probe that fails to compile is reported
                        print(f"{rows:3} rows {shape:3} {name:36} failed: {type(e).__name__}: {str(e)[:300]}",
                              flush=True)
                        continue
                    moved = N * K * 2 * (2 if p.kind == "copy" else 1)
                    res: dict[str, Any] = {"rows": rows, "shape": shape, "probe": name, "round": rnd, "us": us,
                                           "tb_s": moved / us / 1e6, "rel_diff": rel}
                    if k is not None:
                        res.update(regs=k.n_regs, spills=k.n_spills, shared=k.metadata.shared,
                                   wgmma="wgmma" in k.asm["ptx"])
                    results.append(res)
                    extra = (f" regs {res['regs']:3} spills {res['spills']} smem {res['shared'] // 1024:3} KB "
                             f"wgmma {res['wgmma']}" if k is not None else "")
                    print(f"{rows:3} rows {shape:3} {name:36} round {rnd} {us:7.2f} us {res['tb_s']:5.2f} TB/s "
                          f"rel {rel:.1e}{extra}", flush=True)
            del ws
            torch.cuda.empty_cache()
    (out / "few_row_gemm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
