"""Why the decode step's projections run slower inside the layer chain than alone (RESULTS.md
session 10: cuBLAS in_proj 19.9 µs a layer in the batch-32 chain, 15.7 µs in a chain of in_projs).

The batch-32 chain add_rms_norm -> in_proj -> X -> out_proj over L layers' own weights and state
(Mamba2-2.7B shape, bf16, fp32 state), in a CUDA graph, with X one of:
  ssu    the engine's gated state update (reads and writes the 84 MB of state)
  rw     the same state bytes read and written by a plain in-place scale (no state-update math)
  read   the same state bytes only read (a sum)
  none   nothing between the projections
Each kernel's duration per layer inside the replayed graph (torch.profiler) and the chain's µs
per layer. If the projections slow down after `rw` as after `ssu` but not after `read`, the cost is
the state's write-back landing on them, which no projection kernel can avoid.

    python benchmarks/chain_writeback_gpu.py     (CUDA only; JSON to $OUT/chain_writeback.json)
"""

from __future__ import annotations

import functools
import json
import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.linear_gpu import graph_time_us
from benchmarks.pdl_gpu import D_INNER, EPS, G, H, Wide
from pd_ssm.kernels.mixer_decode_triton import mamba2_decode_step_triton
from pd_ssm.kernels.rmsnorm import RowRms
from pd_ssm.kernels.rmsnorm_triton import add_rms_norm_triton

BATCH, L = 32, 32


class Chain(Wide):
    """pdl_gpu.Wide's weights and pools at BATCH rows over L layers, and the inputs of the variants."""

    def __init__(self) -> None:
        dev = torch.device("cuda")
        super().__init__(BATCH, L, dev)
        self.sq = torch.rand(BATCH, H, device=dev) * D_INNER
        self.g = (torch.randn(BATCH, D_INNER, device=dev)).to(torch.bfloat16)
        self.sink = torch.zeros(BATCH, device=dev)

    def run_with(self, between: str, _: int = 0) -> torch.Tensor:
        delta, residual, x_rms = self.delta, self.residual, RowRms(self.sq, D_INNER, EPS)
        for i in range(L):
            normed, residual = add_rms_norm_triton(delta, residual, self.norm_w, EPS, residual_dtype=torch.bfloat16,
                                                   x_rms=x_rms)
            proj = F.linear(normed, self.w_in[i])
            g = self.g
            if between == "ssu":
                gs = mamba2_decode_step_triton(proj, self.conv[i], self.cw, self.cb, self.ssm[i], self.A, self.D,
                                               self.dt_bias, self.gate_w, state_indices=self.slots, ngroups=G)
                g, x_rms = gs.g, RowRms(gs.sq, D_INNER, EPS)
            elif between == "rw":
                self.ssm[i].mul_(0.999)
            elif between == "read":
                self.sink += self.ssm[i].sum(dim=(1, 2, 3))
            delta = F.linear(g, self.w_out[i])
        return torch.cat([delta, residual])


def kernel_us(fn: Callable[[], object]) -> dict[str, float]:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:48]] += e.device_time_total / 3 / L
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    chain = Chain()
    res = []
    for between in ("ssu", "rw", "read", "none", "ssu"):
        us = graph_time_us(chain.run_with, between, [0]) / L
        per = kernel_us(functools.partial(chain.run_with, between))
        res.append({"between": between, "us_per_layer": us, "kernels": per})
        top = "  ".join(f"{v:6.2f} {k[:28]}" for k, v in list(per.items())[:6])
        print(f"{between:5} {us:7.2f} us/layer | {top}", flush=True)
    (out / "chain_writeback.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
