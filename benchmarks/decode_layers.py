"""Mamba2-2.7B-shaped decode layers for the layer-chain benchmarks (decode_chain_gpu.py,
wide_out_proj_gpu.py, pdl_gpu.py): every layer's own weights and pools, so a chain of L layers
streams L layers' bytes (far past L2), and the timing of one chain variant.

Shape: d_model 2560, 80 heads x 64, dstate 128, one group, conv width 4; bf16 weights, fp32 state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.linear_gpu import graph_time_us

HID, H, P, N, G, W = 2560, 80, 64, 128, 1, 4
D_INNER, CONV_DIM = H * P, H * P + 2 * G * N
PROJ = D_INNER + CONV_DIM + H
EPS = 1e-5


class DecodeLayers:
    """L layers at `rows` sequences: in_proj / out_proj weights, a pre-norm weight each, conv and SSM
    pools (one slot per sequence), the shared conv, state-update and gate parameters; `restore`
    puts the pools back as they were made. The chain's inputs (residual, delta, squares) are the
    benchmark's own."""

    def __init__(self, L: int, rows: int, dev: torch.device) -> None:
        self.L, self.rows, self.dev = L, rows, dev
        r = self.rand
        self.w_in = [r(PROJ, HID, scale=HID ** -0.5) for _ in range(L)]
        self.w_out = [r(HID, D_INNER, scale=D_INNER ** -0.5) for _ in range(L)]
        self.norm_w = [1 + r(HID, scale=0.1) for _ in range(L)]
        self.conv = [r(rows, CONV_DIM, W - 1) for _ in range(L)]
        self.ssm = [r(rows, H, P, N, scale=0.1, dtype=torch.float32) for _ in range(L)]
        self.snap = [(c.clone(), s.clone()) for c, s in zip(self.conv, self.ssm, strict=True)]
        self.cw, self.cb = r(CONV_DIM, W, scale=0.5), r(CONV_DIM, scale=0.1)
        self.A = -torch.rand(H, device=dev) - 0.5
        self.D, self.dt_bias = r(H, dtype=torch.float32), r(H, scale=0.5, dtype=torch.float32)
        self.gate_w = 1 + r(D_INNER, scale=0.1)
        self.slots = torch.randperm(rows, device=dev).to(torch.int32)

    def rand(self, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Normal random values of `shape` times `scale` on the layers' device, in `dtype`."""
        return (torch.randn(*shape, device=self.dev) * scale).to(dtype)

    def restore(self) -> None:
        for (c0, s0), c, s in zip(self.snap, self.conv, self.ssm, strict=True):
            c.copy_(c0)
            s.copy_(s0)


def time_chain(layers: DecodeLayers, run: Callable[[Any, int], torch.Tensor], arg: Any) -> tuple[torch.Tensor, float]:
    """(the chain's output from the restored pools, µs a layer of `run(arg)` replayed in a CUDA graph).
    A variant that fails to compile or capture raises."""
    layers.restore()
    got = run(arg, 0).clone()
    torch.cuda.synchronize()
    return got, graph_time_us(run, arg, [0]) / layers.L


def profile_replay(layers: DecodeLayers, run: Callable[[Any, int], torch.Tensor], arg: Any) -> list[dict[str, Any]]:
    """Each kernel's own and attributed µs per layer in two replays of `run(arg)`'s graph
    (graph_timeline_gpu.attribute: PDL overlap counted once), the first six printed."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.graph_timeline_gpu import attribute, kernels_of, trace_events

    layers.restore()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(arg, 0)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            g.replay()
        torch.cuda.synchronize()
    rows = attribute(kernels_of(trace_events(prof)), 2 * layers.L)
    for r in rows[:6]:
        print(f"    x{r['launches']:5.2f} own {r['own_us']:6.2f} attributed {r['attributed_us']:6.2f} idle "
              f"{r['idle_before_us']:5.2f}  {r['kernel']}", flush=True)
    return rows
