"""A batch-1 decode step's per-layer kernel chain in one CUDA graph, with and without programmatic
dependent launch (kernels/pdl.py), and how many weight columns the GEMVs load before their gate.

Mamba2-2.7B shape (d_model 2560, 80 heads x 64, dstate 128, one group, conv width 4), bf16, fp32
state, one sequence. Per layer, on that layer's own weights and pools (64 layers: 5.4 GB of weights,
far past L2), the launches a deferred-norm Mamba2 block makes at batch 1:

  add_rms_norm (residual add, the previous block's deferred scale) -> in_proj GEMV [10576 x 2560]
  -> conv update -> state update + gate + squares -> out_proj GEMV [2560 x 5120]

Variants: PD_SSM_PDL=0 (every launch waits for the last to complete) and PDL, on the default GEMV
tiles (out_proj's loads its first 2048 weight columns into registers before its gate), and with
--sweep other tiles under PDL. µs per layer (median of 7 replays), the bytes
that must move (weights + state read and written) over that time, and whether the output equals
the no-PDL chain's (to the bit when the arithmetic is the same; close when a prefetch changes the
order of the K sum).

Then the step at 32 and 128 rows, where Mamba2 blocks run the three-kernel path between cuBLAS
projections (layers/mixer2.py, DEFER_BELOW_DECODE_ROWS): norm, in_proj, conv, state update, gated
norm, out_proj, with PD_SSM_PDL=0 and 1 alternately, twice each.

    python benchmarks/pdl_gpu.py [--sweep]   (CUDA only; JSON to $OUT/pdl.json; --sweep: other GEMV tiles)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

from benchmarks.decode_layers import CONV_DIM, D_INNER, EPS, HID, PROJ, DecodeLayers, G, H, N, P, time_chain
from pd_ssm.kernels.conv1d_triton import causal_conv1d_update_triton
from pd_ssm.kernels.mixer_decode_triton import default_config, launch_decode_step
from pd_ssm.kernels.rmsnorm import RowRms
from pd_ssm.kernels.rmsnorm_triton import add_rms_norm_triton, rms_norm_gated_triton
from pd_ssm.kernels.skinny_linear_triton import FMA_TILE, FMA_TILE_NARROW, LinearTile, skinny_linear_triton
from pd_ssm.kernels.ssu_triton import selective_state_update_triton


class Chain(DecodeLayers):
    """L layers at one sequence, and the whole chain over them."""

    def __init__(self, L: int, dev: torch.device) -> None:
        super().__init__(L, 1, dev)
        self.residual = self.rand(1, HID)
        self.delta = self.rand(1, HID)
        self.sq = torch.rand(1, H, device=dev) * D_INNER
        self.cfg = default_config(1, P, N, torch.float32)

    def run(self, v: Variant, _: int = 0) -> torch.Tensor:
        delta, residual, x_rms = self.delta, self.residual, RowRms(self.sq, D_INNER, EPS)
        for i in range(self.L):
            normed, residual = add_rms_norm_triton(delta, residual, self.norm_w[i], EPS,
                                                   residual_dtype=torch.bfloat16, x_rms=x_rms)
            proj = skinny_linear_triton(normed, self.w_in[i], tile=v.tiles[0])
            gs = launch_decode_step(proj, self.conv[i], self.cw, self.cb, self.ssm[i], self.A, self.D,
                                    self.dt_bias, self.gate_w, self.slots, G, self.cfg)
            delta = skinny_linear_triton(gs.g, self.w_out[i], tile=v.tiles[1])
            x_rms = RowRms(gs.sq, D_INNER, EPS)
        return torch.cat([delta, residual])


class Variant(NamedTuple):
    name: str
    pdl: bool
    tiles: tuple[LinearTile, LinearTile] = (FMA_TILE, FMA_TILE_NARROW)


def variants(sweep: bool) -> list[Variant]:
    """No PDL and PDL on the default tiles (out_proj's with its weight prefetch), twice each; with
    `sweep`, other GEMV tiles under PDL: (block_n, block_k, warps, stages, prefetch_k)."""
    default = (FMA_TILE, FMA_TILE_NARROW)
    out = [Variant("no PDL", False, default), Variant("PDL", True, default)]
    if sweep:
        for n, k, w, st, pre in ((4, 512, 4, 4, 2048), (4, 1024, 4, 3, 2048), (8, 1024, 4, 3, 2048),
                                 (8, 512, 8, 4, 2048), (16, 512, 4, 3, 2048), (8, 512, 4, 4, 1024)):
            out.append(Variant(f"PDL, out_proj tile {n}x{k} w{w} s{st} pre {pre}", True,
                               (FMA_TILE, LinearTile(n, k, w, st, prefetch_k=pre))))
        for n, k, w, st in ((8, 512, 4, 4), (16, 512, 4, 3), (32, 256, 4, 3), (16, 256, 8, 3)):
            out.append(Variant(f"PDL, in_proj tile {n}x{k} w{w} s{st}", True,
                               (LinearTile(n, k, w, st), FMA_TILE_NARROW)))
    out += [Variant("no PDL (again)", False, default), Variant("PDL (again)", True, default)]
    return out


class Wide(DecodeLayers):
    """The step at 32 / 128 rows: the three-kernel path between cuBLAS projections (DEFER_BELOW_DECODE_ROWS)."""

    def __init__(self, batch: int, L: int, dev: torch.device) -> None:
        super().__init__(L, batch, dev)
        self.batch = batch
        self.residual, self.delta = self.rand(batch, HID), self.rand(batch, HID)

    def run(self, _v: object = None, _i: int = 0) -> torch.Tensor:
        b, delta, residual = self.batch, self.delta, self.residual
        for i in range(self.L):
            normed, residual = add_rms_norm_triton(delta, residual, self.norm_w[i], EPS,
                                                   residual_dtype=torch.bfloat16)
            proj = torch.nn.functional.linear(normed, self.w_in[i])
            z, xbc, dt = proj.split([D_INNER, CONV_DIM, H], dim=-1)
            xbc = causal_conv1d_update_triton(xbc, self.conv[i], self.cw, self.cb, state_indices=self.slots)
            x, B, C = xbc.split([D_INNER, G * N, G * N], dim=-1)
            y = selective_state_update_triton(self.ssm[i], x.reshape(b, H, P), dt, self.A, B.reshape(b, G, N),
                                              C.reshape(b, G, N), state_indices=self.slots, D=self.D,
                                              dt_bias=self.dt_bias)
            y = rms_norm_gated_triton(y.reshape(b, D_INNER), z, self.gate_w, EPS, D_INNER)
            delta = torch.nn.functional.linear(y, self.w_out[i])
        return torch.cat([delta, residual])


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    L = 64
    chain = Chain(L, dev)
    moved = (PROJ * HID + HID * D_INNER) * 2 + 2 * H * P * N * 4  # bytes a layer: weights + state r/w
    results: list[dict[str, Any]] = []
    want: torch.Tensor | None = None
    for v in variants("--sweep" in sys.argv):
        os.environ["PD_SSM_PDL"] = "1" if v.pdl else "0"
        try:
            got, us = time_chain(chain, chain.run, v)
        except Exception as e:  # noqa: BLE001 -- a variant that fails to compile or capture is reported
            print(f"{v.name:44} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            results.append({"batch": 1, "variant": v.name, "error": str(e)[:1000]})
            continue
        if want is None:
            want = got
        row = {"batch": 1, "variant": v.name, "us_per_layer": us, "gbps": moved / us / 1e3,
               "equal_to_no_pdl": bool(torch.equal(got, want)),
               "max_abs_diff": float((got.float() - want.float()).abs().max())}
        results.append(row)
        print(f"{v.name:44} {row['us_per_layer']:7.2f} us/layer  {row['gbps']:6.0f} GB/s  equal {row['equal_to_no_pdl']}"
              f"  max diff {row['max_abs_diff']:.3g}", flush=True)
    del chain
    torch.cuda.empty_cache()
    for batch, layers in ((32, 16), (128, 8)):
        wide = Wide(batch, layers, dev)
        outs = {}
        for pdl in ("0", "1", "0", "1"):
            os.environ["PD_SSM_PDL"] = pdl
            outs[pdl], us = time_chain(wide, wide.run, None)
            results.append({"batch": batch, "variant": f"three kernels, PDL={pdl}", "us_per_layer": us})
            print(f"batch {batch:3} three kernels between cuBLAS, PDL={pdl}: {us:8.2f} us/layer", flush=True)
        print(f"batch {batch:3}: PDL output equal: {bool(torch.equal(outs['0'], outs['1']))}", flush=True)
        del wide
        torch.cuda.empty_cache()
    os.environ.pop("PD_SSM_PDL")
    (out / "pdl.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
