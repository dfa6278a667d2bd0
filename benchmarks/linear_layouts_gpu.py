"""cuBLAS variants for the decode-step linears: does a layout or the Lt path stream weights faster?

At 32-128 rows cuBLAS's `F.linear` streams out_proj [2560 x 5120] at ~2.4 TB/s and in_proj
[10576 x 2560] at ~3.3 TB/s (RESULTS.md, session 2) against ~4.2 TB/s of copy bandwidth. Variants,
each as 64 calls in one CUDA graph on 64 distinct weights (rotating past L2):

  linear     F.linear(x, W), W [N, K] (the checkpoint layout: a "TN" GEMM)
  nn         x @ Wt, Wt = W.T made contiguous [K, N] (an "NN" GEMM)
  addmm      torch.addmm(zero bias, x, W.T) (cublasLt with a bias epilogue)

    python benchmarks/linear_layouts_gpu.py      (CUDA only; JSON to $OUT/linear_layouts.json)
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.linear_gpu import CALLS, SHAPES, graph_time_us


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    results: list[dict[str, Any]] = []
    for (name, (n, k)), rows in itertools.product(SHAPES.items(), (1, 8, 32, 64, 128)):
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05 for _ in range(CALLS)]
        wts = [w.t().contiguous() for w in ws]
        zero = torch.zeros(n, device=dev, dtype=torch.bfloat16)
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        want = F.linear(x.float(), ws[0].float())
        nbytes = n * k * 2 + rows * (k + n) * 2
        variants = {
            "linear": (F.linear, ws),
            "nn": (torch.matmul, wts),
            "addmm": (lambda a, w, zero=zero: torch.addmm(zero, a, w.t()), ws),
        }
        row: dict[str, Any] = {"shape": name, "rows": rows}
        for vname, (fn, weights) in variants.items():
            got = fn(x, weights[0]).float()
            err = ((got - want).norm() / want.norm()).item()
            us = graph_time_us(fn, x, weights)
            row[vname] = {"us": us, "gbps": nbytes / us / 1e3, "rel_l2": err}
        results.append(row)
        print(f"{name:9} rows {rows:4}: " + "  ".join(
            f"{v} {row[v]['us']:6.2f} us ({row[v]['gbps']:5.0f} GB/s, err {row[v]['rel_l2']:.1e})" for v in variants
        ), flush=True)
        del ws, wts
        torch.cuda.empty_cache()
    (out / "linear_layouts.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
