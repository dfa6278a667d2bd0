"""The decode step between the projections, per layer, in CUDA graphs: three kernels against two.

Mamba2-2.7B shape (80 heads x 64, dstate 128, one group, conv width 4), bf16 activations, fp32
state, at batch 1 / 32 / 128. Each variant runs over L layers of their own pools in one CUDA graph
(the pools rotate far past L2), median of 7 replays, µs per layer:

  three kernels   conv update + state update + gated norm (the path before kernels/mixer_decode.py)
  conv + gated P/W  the conv update, then state update + gate + squares with BLOCK_P = P, W warps
  state update    the plain state update alone (ssu_triton.py), for scale

Each variant's g is checked against the three-kernel path's (equal, to the bit). GB/s counts the
state read and written, the only large operand.

    python benchmarks/decode_step_gpu.py      (CUDA only; JSON to $OUT/decode_step.json)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from benchmarks.linear_gpu import graph_time_us
from pd_ssm.kernels.conv1d_triton import causal_conv1d_update_triton
from pd_ssm.kernels.mixer_decode_triton import launch_decode_step
from pd_ssm.kernels.rmsnorm_triton import rms_norm_gated_squares_triton
from pd_ssm.kernels.ssu_triton import SSUConfig, selective_state_update_triton

H, P, N, G, W = 80, 64, 128, 1, 4
D_INNER, CONV_DIM = H * P, H * P + 2 * G * N


class Layers:
    """L layers' inputs and pools for one batch size, and the variants over all of them."""

    def __init__(self, batch: int, L: int, dev: torch.device) -> None:
        def r(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
            return (torch.randn(*shape, device=dev) * scale).to(dtype)

        self.batch, self.L = batch, L
        self.proj = [r(batch, D_INNER + CONV_DIM + H) for _ in range(L)]
        self.conv = [r(batch, CONV_DIM, W - 1) for _ in range(L)]
        self.ssm = [r(batch, H, P, N, dtype=torch.float32) for _ in range(L)]
        self.snap = [(c.clone(), s.clone()) for c, s in zip(self.conv, self.ssm, strict=True)]
        self.cw, self.cb = r(CONV_DIM, W, scale=0.5), r(CONV_DIM, scale=0.1)
        self.A = -torch.rand(H, device=dev) - 0.5
        self.D, self.dt_bias = r(H, dtype=torch.float32), r(H, scale=0.5, dtype=torch.float32)
        self.nw = 1 + r(D_INNER, scale=0.1)
        self.slots = torch.randperm(batch, device=dev).to(torch.int32)

    def release(self) -> None:
        self.proj, self.conv, self.ssm, self.snap = [], [], [], []

    def restore(self) -> None:
        for (c0, s0), c, s in zip(self.snap, self.conv, self.ssm, strict=True):
            c.copy_(c0)
            s.copy_(s0)

    def three(self, i: int) -> torch.Tensor:
        b = self.batch
        z, xbc, dt = self.proj[i].split([D_INNER, CONV_DIM, H], dim=-1)
        xbc = causal_conv1d_update_triton(xbc, self.conv[i], self.cw, self.cb, state_indices=self.slots)
        x, B, C = xbc.split([D_INNER, G * N, G * N], dim=-1)
        y = selective_state_update_triton(self.ssm[i], x.reshape(b, H, P), dt, self.A, B.reshape(b, G, N),
                                          C.reshape(b, G, N), state_indices=self.slots, D=self.D, dt_bias=self.dt_bias)
        return rms_norm_gated_squares_triton(y.reshape(b, D_INNER), z, self.nw).g

    def gated(self, i: int, cfg: SSUConfig) -> torch.Tensor:
        return launch_decode_step(self.proj[i], self.conv[i], self.cw, self.cb, self.ssm[i], self.A, self.D,
                                  self.dt_bias, self.nw, self.slots, G, cfg).g

    def ssu_only(self, i: int) -> None:
        b = self.batch
        xbc = self.proj[i][:, D_INNER:D_INNER + CONV_DIM]
        x, B, C = xbc.split([D_INNER, G * N, G * N], dim=-1)
        selective_state_update_triton(self.ssm[i], x.reshape(b, H, P), self.proj[i][:, -H:], self.A,
                                      B.reshape(b, G, N), C.reshape(b, G, N), state_indices=self.slots, D=self.D,
                                      dt_bias=self.dt_bias)

    def run_one(self, cfg: SSUConfig | str, i: int) -> None:
        if cfg == "three":
            self.three(i)
        elif cfg == "ssu":
            self.ssu_only(i)
        else:
            assert isinstance(cfg, SSUConfig)
            self.gated(i, cfg)


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    results: list[dict[str, Any]] = []
    cfgs: dict[str, SSUConfig | str] = {"three kernels": "three", "state update": "ssu"}
    for bp, nwp in ((8, 4), (16, 4), (32, 4), (16, 2)):
        cfgs[f"conv + gated {bp}/{nwp}"] = SSUConfig(bp, nwp)
    for batch, L in ((1, 64), (32, 16), (128, 8)):
        lay = Layers(batch, L, dev)
        lay.restore()
        want = lay.three(0)
        state_bytes = 2 * batch * H * P * N * 4
        for name, cfg in cfgs.items():
            lay.restore()
            exact = not isinstance(cfg, SSUConfig) or bool(torch.equal(lay.gated(0, cfg), want))
            us = graph_time_us(lay.run_one, cfg, list(range(L)))  # lay.run_one(cfg, i) for every layer i
            row = {"batch": batch, "variant": name, "us_per_layer": us, "state_gbps": state_bytes / us / 1e3,
                   "equal_to_three_kernels": exact}
            results.append(row)
            print(f"batch {batch:4} {name:18} {us:8.2f} us/layer  {row['state_gbps']:6.0f} GB/s state  "
                  f"equal {exact}", flush=True)
        lay.release()
        torch.cuda.empty_cache()
    (out / "decode_step.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
