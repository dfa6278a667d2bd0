"""Decode-step linears on the GPU: skinny_linear_triton (tile sweep) against torch's F.linear (cuBLAS).

Shapes of Mamba2-2.7B: in_proj [10576 x 2560], out_proj [2560 x 5120], bf16, at 1 / 32 / 128 rows.
Each variant runs as 64 back-to-back calls captured in one CUDA graph (how the decode step runs
them), each call on its own weight matrix (64 x 54 MB rotates far past L2), so the figure is the
weight-streaming rate the decode step sees.  Correctness: each variant against the fp32 reference.

    python benchmarks/linear_gpu.py [--quick]     (CUDA only; JSON to $OUT/linear.json)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pd_ssm.kernels.skinny_linear_triton import LinearTile, skinny_linear_ref, skinny_linear_triton

SHAPES = {"in_proj": (10576, 2560), "out_proj": (2560, 5120)}
CALLS = 64


def graph_time_us(fn: Any, xs: Any, ws: list[Any]) -> float:
    """Median µs per call of `fn(xs, w)` over len(ws) calls in one CUDA graph, one w each."""
    fn(xs, ws[0])  # compile / warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            fn(xs, w)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(ws))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few tiles only")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    results: list[dict[str, Any]] = []
    fma_tiles = [LinearTile(*t) for t in itertools.product((8, 16, 32), (256, 512), (4, 8), (3, 4))]
    dot_tiles = [LinearTile(*t) for t in itertools.product((16, 32, 64), (64, 128), (4,), (3, 4), (1, 2, 4))]
    if args.quick:
        fma_tiles, dot_tiles = fma_tiles[:4], dot_tiles[:4]
    ok = True
    for (name, (n, k)), rows in itertools.product(SHAPES.items(), (1, 4, 8, 32, 128)):
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05 for _ in range(CALLS)]
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        want = skinny_linear_ref(x, ws[0]).float()
        nbytes = n * k * 2 + rows * (k + n) * 2
        torch_us = graph_time_us(F.linear, x, ws)
        best: dict[str, Any] | None = None
        for tile in fma_tiles if rows == 1 else dot_tiles:
            try:
                got = skinny_linear_triton(x, ws[0], tile=tile).float()
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped, and said so
                print(f"{name} rows {rows} {tile}: {type(e).__name__}: {str(e)[:80]}")
                continue
            err = ((got - want).norm() / want.norm()).item()
            if err > 1e-2:
                ok = False
                print(f"MISMATCH {name} rows {rows} {tile}: rel-L2 {err:.2e}")
                continue
            us = graph_time_us(lambda a, b, t=tile: skinny_linear_triton(a, b, tile=t), x, ws)
            if best is None or us < best["us"]:
                best = {"tile": list(tile), "us": us, "rel_l2": err}
        row = {"shape": name, "rows": rows, "torch_us": torch_us, "torch_gbps": nbytes / torch_us / 1e3,
               "best": best, "speedup": (torch_us / best["us"]) if best else None,
               "best_gbps": (nbytes / best["us"] / 1e3) if best else None}
        results.append(row)
        print(f"{name:9} rows {rows:4}: torch {torch_us:7.2f} us ({row['torch_gbps']:6.0f} GB/s)  "
              + (f"triton {best['us']:7.2f} us ({row['best_gbps']:6.0f} GB/s) {best['tile']}  x{row['speedup']:.2f}"
                 if best else "triton: no tile"), flush=True)
        del ws
        torch.cuda.empty_cache()
    (out / "linear.json").write_text(json.dumps(results, indent=1))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
