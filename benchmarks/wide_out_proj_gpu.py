"""The batch-32 decode chain with out_proj on cuBLAS against the Triton split-K GEMM
(skinny_linear_triton's DOT path, partials summed by its own reduce launch): whether a pending norm
at 32 rows (the reduce doing the residual add, as out_proj_add does at one row) could start from a
GEMM that keeps up with cuBLAS inside the chain.

Mamba2-2.7B shape, bf16, fp32 state and residual, 32 sequences, 32 layers on their own weights and
pools, one CUDA graph, PDL as the engine runs it; per layer: add_rms_norm (deferred gated-norm
scale) -> in_proj (cuBLAS) -> conv update + gated state update (mamba2_decode_step_triton) ->
out_proj. µs per layer, median of 7 replays; variants alternate, each twice; each variant's last
residual is compared with cuBLAS's (the K split sums in another order: close, not equal).

    PYTHONPATH=. python3 benchmarks/wide_out_proj_gpu.py     (CUDA only; JSON to $OUT/wide_out_proj.json)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from benchmarks.linear_gpu import graph_time_us
from pd_ssm.kernels.mixer_decode_triton import mamba2_decode_step_triton
from pd_ssm.kernels.rmsnorm import RowRms
from pd_ssm.kernels.rmsnorm_triton import add_rms_norm_triton
from pd_ssm.kernels.skinny_linear_triton import LinearTile, skinny_linear_triton

HID, H, P, N, G, W = 2560, 80, 64, 128, 1, 4
D_INNER, CONV_DIM = H * P, H * P + 2 * G * N
PROJ = D_INNER + CONV_DIM + H
EPS = 1e-5
L, B = 32, 32


class Wide:
    def __init__(self, dev: torch.device) -> None:
        def r(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
            return (torch.randn(*shape, device=dev) * scale).to(dtype)

        self.w_in = [r(PROJ, HID, scale=HID ** -0.5) for _ in range(L)]
        self.w_out = [r(HID, D_INNER, scale=D_INNER ** -0.5) for _ in range(L)]
        self.norm_w = 1 + r(HID, scale=0.1)
        self.conv = [r(B, CONV_DIM, W - 1) for _ in range(L)]
        self.ssm = [r(B, H, P, N, scale=0.1, dtype=torch.float32) for _ in range(L)]
        self.snap = [(c.clone(), s.clone()) for c, s in zip(self.conv, self.ssm, strict=True)]
        self.cw, self.cb = r(CONV_DIM, W, scale=0.5), r(CONV_DIM, scale=0.1)
        self.A = -torch.rand(H, device=dev) - 0.5
        self.D, self.dt_bias = r(H, dtype=torch.float32), r(H, scale=0.5, dtype=torch.float32)
        self.gate_w = 1 + r(D_INNER, scale=0.1)
        self.slots = torch.randperm(B, device=dev).to(torch.int32)
        self.residual, self.delta = r(B, HID, dtype=torch.float32), r(B, HID)
        self.sq = torch.rand(B, 4 * H, device=dev) * D_INNER / (4 * H)

    def restore(self) -> None:
        for (c0, s0), c, s in zip(self.snap, self.conv, self.ssm, strict=True):
            c.copy_(c0)
            s.copy_(s0)

    def run(self, tile: LinearTile | None, _: int = 0) -> torch.Tensor:
        delta, residual, x_rms = self.delta, self.residual, RowRms(self.sq, D_INNER, EPS)
        for i in range(L):
            normed, residual = add_rms_norm_triton(delta, residual, self.norm_w, EPS, residual_dtype=torch.float32,
                                                   x_rms=x_rms)
            proj = torch.nn.functional.linear(normed, self.w_in[i])
            gs = mamba2_decode_step_triton(proj, self.conv[i], self.cw, self.cb, self.ssm[i], self.A, self.D,
                                           self.dt_bias, self.gate_w, state_indices=self.slots, ngroups=G)
            x_rms = RowRms(gs.sq, D_INNER, EPS)
            delta = (torch.nn.functional.linear(gs.g, self.w_out[i]) if tile is None
                     else skinny_linear_triton(gs.g, self.w_out[i], tile=tile))
        return add_rms_norm_triton(delta, residual, self.norm_w, EPS, residual_dtype=torch.float32,
                                   x_rms=x_rms).residual


TILES: dict[str, LinearTile | None] = {
    "cuBLAS": None,
    "DOT 64x128 w4 s4 split 2": LinearTile(64, 128, 4, 4, split_k=2),
    "DOT 64x128 w4 s4 split 4": LinearTile(64, 128, 4, 4, split_k=4),
    "DOT 32x128 w4 s4 split 4": LinearTile(32, 128, 4, 4, split_k=4),
    "DOT 128x64 w4 s4 split 4": LinearTile(128, 64, 4, 4, split_k=4),
    "DOT 64x64 w4 s4 split 8": LinearTile(64, 64, 4, 4, split_k=8),
    "DOT 32x256 w4 s3 split 2": LinearTile(32, 256, 4, 3, split_k=2),
}


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    chain = Wide(torch.device("cuda"))
    results: list[dict[str, Any]] = []
    want: torch.Tensor | None = None
    for rnd in range(2):
        for name, tile in TILES.items():
            chain.restore()
            try:
                got = chain.run(tile).clone()
                torch.cuda.synchronize()
                us = graph_time_us(chain.run, tile, [0]) / L
            except Exception as e:  # noqa: BLE001 -- a variant that fails to compile or capture is reported
                print(f"{name:28} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            want = got if want is None else want
            rel = float((got - want).norm() / want.norm())
            results.append({"variant": name, "round": rnd, "us_per_layer": us, "rel_diff_to_cublas": rel})
            print(f"{name:28} round {rnd}  {us:7.2f} us/layer  residual rel diff {rel:.2e}", flush=True)
    (out / "wide_out_proj.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
