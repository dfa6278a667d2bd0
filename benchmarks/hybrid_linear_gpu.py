"""The decode-step linears of the three bench shapes (Bamba-9B, Nemotron-H-8B, Mamba2-2.7B) at a few
rows: cuBLAS against the few-row DOT tiles of skinny_gemm_triton with and without a split of K (the
one-row GEMV at one row); for the lm_head, cuBLAS's fp32-output launch (compute_logits) against them.

Why: the eager profile of a Bamba-9B decode step at batch 32 (RESULTS.md, session 26) has the mixers'
out_proj (8192 -> 4096) as cuBLAS split-K at ~2.7 TB/s, where the larger projections stream at
3.7-3.8; session 27 chose skinny_linear_triton.few_rows_tile from this sweep. Each variant runs as
back-to-back calls in one CUDA graph, each on its own weight copy (past L2), as in
benchmarks/linear_gpu.py; each is checked against the fp32 reference first.

    PYTHONPATH=. [HYB_ROWS=2,4,8,16] [HYB_SHAPES=lm_head,...] [HYB_TILES=64:128:4:4,...] [HYB_SPLITS=1,2,4] \
        python3 benchmarks/hybrid_linear_gpu.py
    (CUDA only; JSON to $OUT/hybrid_linear.json)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.linear_gpu import graph_time_us
from pd_ssm.kernels.skinny_linear_triton import LinearTile, skinny_linear_ref, skinny_linear_triton

# name: (N, K) of weight [N, K]
SHAPES = {
    "out_proj 8192->4096": (4096, 8192),
    "bamba down 14336->4096": (4096, 14336),
    "nemotron down 21504->4096": (4096, 21504),
    "bamba gate_up 4096->28672": (28672, 4096),
    "nemotron up 4096->21504": (21504, 4096),
    "bamba in_proj 4096->16768": (16768, 4096),
    "nemotron in_proj 4096->18560": (18560, 4096),
    "q / o 4096->4096": (4096, 4096),
    "k / v 4096->1024": (1024, 4096),
    "2.7b in_proj 2560->10576": (10576, 2560),
    "2.7b out_proj 5120->2560": (2560, 5120),
    # the logits: one cuBLAS launch writing fp32 (models/base.py compute_logits) is the baseline there
    "2.7b lm_head 2560->50288": (50288, 2560),
    "bamba lm_head 4096->128256": (128256, 4096),
}
if os.environ.get("HYB_SHAPES"):
    SHAPES = {k: v for k, v in SHAPES.items() if any(f in k for f in os.environ["HYB_SHAPES"].split(","))}
ROWS = [int(r) for r in os.environ.get("HYB_ROWS", "2,4,8,16,32").split(",")]
# HYB_TILES: "bn:bk:warps:stages,..." ; HYB_SPLITS: "1,2,4"
_TILE_SPECS = [tuple(int(v) for v in t.split(":")) for t in
               os.environ.get("HYB_TILES", "32:128:4:4,64:128:4:4,64:256:4:3,128:128:8:3").split(",")]
TILES = {f"dot {bn}x{bk} w{w} s{st} split {sk}": LinearTile(bn, bk, w, st, split_k=sk)
         for bn, bk, w, st in _TILE_SPECS
         for sk in (int(v) for v in os.environ.get("HYB_SPLITS", "1,2,4").split(","))}


def weight_copies(N: int, K: int, g: torch.Generator) -> list[torch.Tensor]:
    """Random bf16 [N, K] weights on g's device, copies enough for >= 1 GB (far past L2), 4 to 32 of them:
    a graph of back-to-back calls, one copy each, streams every weight from DRAM."""
    copies = max(4, min(32, (1 << 30) // (N * K * 2)))
    return [torch.randn(N, K, device=g.device, generator=g).bfloat16() * 0.02 for _ in range(copies)]


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
            ref = skinny_linear_ref(x, ws[0])
            line = {"shape": name, "rows": M}
            if "lm_head" in name:
                us = graph_time_us(lambda xs, w: torch.mm(xs, w.t(), out_dtype=torch.float32), x, ws)
            else:
                us = graph_time_us(lambda xs, w: F.linear(xs, w), x, ws)
            line["cublas"] = us
            tiles = TILES if M > 1 else {"gemv (one row)": None}
            for tname, t in tiles.items():
                if t is not None and K % t.split_k:
                    continue
                got = skinny_linear_triton(x, ws[0], tile=t)
                err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                if err > 2e-2:
                    line[tname] = f"wrong ({err:.2e})"
                    continue
                line[tname] = graph_time_us(lambda xs, w, t=t: skinny_linear_triton(xs, w, tile=t), x, ws)
            best = min((v, k) for k, v in line.items() if isinstance(v, float))
            print(f"{name:28s} M {M:3d}  cuBLAS {line['cublas']:7.1f} us ({nbytes / line['cublas'] / 1e6:5.2f} TB/s)"
                  f"  best {best[1]:28s} {best[0]:7.1f} us ({nbytes / best[0] / 1e6:5.2f} TB/s)", flush=True)
            results.append(line)
    (out / "hybrid_linear.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
