"""The decode chain at a few rows: out_proj on cuBLAS against the Triton split-K GEMM
(skinny_gemm_triton.py, partials summed by its own reduce launch), and the pending norm's chain
(kernels/pending_norm.py, main since session 18) with other GEMM tiles.

Part 1 (session 18, call 9): whether a pending norm at 32 rows (the reduce doing the residual add,
as out_proj_add does at one row) could start from a GEMM that keeps up with cuBLAS in the chain.
Part 2 (WIDE_PENDING=1): at WIDE_ROWS rows (default 8 and 32), the engine's chain before the
pending norm (norm launch, cuBLAS in_proj, conv + gated state update, cuBLAS out_proj) against the
pending chain (in_proj on the DOT path with the scale, conv, gated state update, split-K out_proj
with the add) over in_proj and out_proj tiles; since session 19 with the conv in in_proj's epilogue
(one launch) against its own launch, and each with every kernel launched without PDL; since session
20 by parts ("no state update", "state update only", "no conv": in_proj's GEMM alone, the state
update on a fixed conv output) and over columns-first tiles (64 columns: the wgmma's M).

Mamba2-2.7B shape, bf16, fp32 state and residual, 32 sequences, 32 layers on their own weights and
pools, one CUDA graph, PDL as the engine runs it; per layer: add_rms_norm (deferred gated-norm
scale) -> in_proj (cuBLAS) -> conv update + gated state update (mamba2_decode_step_triton) ->
out_proj. µs per layer, median of 7 replays; variants alternate, each twice; each variant's last
residual is compared with cuBLAS's (the K split sums in another order: close, not equal).

    PYTHONPATH=. python3 benchmarks/wide_out_proj_gpu.py     (CUDA only; JSON to $OUT/wide_out_proj.json)
    WIDE_PENDING=1 WIDE_ROWS=8,32 PYTHONPATH=. python3 benchmarks/wide_out_proj_gpu.py     (part 2)
    WIDE_VARIANTS="<v>;<v>" WIDE_PROFILE="<v>;<v>" ...     (those variants; the second: kernels attributed)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from benchmarks.decode_layers import (
    CONV_DIM,
    D_INNER,
    EPS,
    HID,
    PROJ,
    DecodeLayers,
    G,
    H,
    profile_replay,
    time_chain,
)
from pd_ssm.kernels import in_proj_conv_triton as in_proj_conv
from pd_ssm.kernels.in_proj_conv_triton import EARLY_TAPS_BLOCK_M, in_proj_conv_triton
from pd_ssm.kernels.mixer_decode_triton import launch_decode_step, mamba2_decode_step_triton
from pd_ssm.kernels.out_proj_add_triton import out_proj_add_triton
from pd_ssm.kernels.pending_norm import PendingNorm
from pd_ssm.kernels.rmsnorm import GatedSquares, RowRms
from pd_ssm.kernels.rmsnorm_triton import add_rms_norm_triton
from pd_ssm.kernels.skinny_linear_triton import LinearTile, skinny_linear_triton
from pd_ssm.kernels.ssu_triton import SSUConfig

L = 32


class Wide(DecodeLayers):
    def __init__(self, dev: torch.device, B: int = 32) -> None:
        super().__init__(L, B, dev)
        self.residual, self.delta = self.rand(B, HID, dtype=torch.float32), self.rand(B, HID)
        self.sq = torch.rand(B, 4 * H, device=dev) * D_INNER / (4 * H)
        # fixed inputs of the partial chains: a gated input for out_proj, in_proj's output and the conv's
        self.delta_in = self.rand(B, D_INNER)
        self.proj0, self.xbc0 = self.rand(B, PROJ), self.rand(B, CONV_DIM)

    def run(self, tile: LinearTile | None, _: int = 0) -> torch.Tensor:
        delta, residual, x_rms = self.delta, self.residual, RowRms(self.sq, D_INNER, EPS)
        for i in range(L):
            normed, residual = add_rms_norm_triton(delta, residual, self.norm_w[i], EPS, residual_dtype=torch.float32,
                                                   x_rms=x_rms)
            proj = torch.nn.functional.linear(normed, self.w_in[i])
            gs = mamba2_decode_step_triton(proj, self.conv[i], self.cw, self.cb, self.ssm[i], self.A, self.D,
                                           self.dt_bias, self.gate_w, state_indices=self.slots, ngroups=G)
            x_rms = RowRms(gs.sq, D_INNER, EPS)
            delta = (torch.nn.functional.linear(gs.g, self.w_out[i]) if tile is None
                     else skinny_linear_triton(gs.g, self.w_out[i], tile=tile))
        return add_rms_norm_triton(delta, residual, self.norm_w[0], EPS, residual_dtype=torch.float32,
                                   x_rms=x_rms).residual

    def run_pending(self, v: WideVariant, _: int = 0) -> torch.Tensor:
        """The pending chain with v's tiles (None: the defaults) and in_proj's conv in one launch or two."""
        os.environ["PD_SSM_PDL"] = "1" if v.pdl else "0"
        in_proj_conv.EARLY_TAPS_BLOCK_M = v.early_block_m or EARLY_TAPS_BLOCK_M
        normed, residual = add_rms_norm_triton(self.delta, self.residual, self.norm_w[0], EPS,
                                               residual_dtype=torch.float32, x_rms=RowRms(self.sq, D_INNER, EPS))
        hidden: torch.Tensor | PendingNorm = normed
        if v.parts == "state update only":  # on fixed inputs: the state's bytes alone
            for i in range(L):
                gs = self.state_update(v, i, self.proj0, self.xbc0)
            os.environ["PD_SSM_PDL"] = "1"
            return gs.g.float()
        for i in range(L):
            pend = isinstance(hidden, PendingNorm)
            if v.parts.startswith("no conv"):  # in_proj's GEMM alone; the state update on a fixed conv output
                proj, xbc = skinny_linear_triton(hidden, self.w_in[i], tile=v.in_tile), self.xbc0
            else:
                proj, xbc = in_proj_conv_triton(hidden, self.w_in[i], None, self.conv[i], self.cw, self.cb,
                                                state_indices=self.slots, conv_start=D_INNER,
                                                tile=v.in_tile if pend else None, fused=pend and v.fused)
            if v.parts.endswith("no state update"):  # out_proj on a fixed gated input: the weights' bytes alone
                gs = GatedSquares(self.delta_in, self.sq)
            else:
                gs = self.state_update(v, i, proj, xbc)
            residual, hidden = out_proj_add_triton(gs.g, self.w_out[i], RowRms(gs.sq, D_INNER, EPS), residual,
                                                   self.norm_w[(i + 1) % L], EPS, residual_dtype=torch.float32,
                                                   tile=v.out_tile)
        os.environ["PD_SSM_PDL"] = "1"
        return residual


    def state_update(self, v: WideVariant, i: int, proj: torch.Tensor, xbc: torch.Tensor) -> GatedSquares:
        """Layer i's gated state update on the conv's output xbc, with v's tile (None: the default)."""
        if v.ssu is None:
            return mamba2_decode_step_triton(proj, self.conv[i], self.cw, self.cb, self.ssm[i], self.A, self.D,
                                             self.dt_bias, self.gate_w, state_indices=self.slots, ngroups=G, xbc=xbc)
        return launch_decode_step(proj, self.conv[i], self.cw, self.cb, self.ssm[i], self.A, self.D, self.dt_bias,
                                  self.gate_w, self.slots, G, v.ssu, xbc)


TILES: dict[str, LinearTile | None] = {
    "cuBLAS": None,
    "DOT 64x128 w4 s4 split 2": LinearTile(64, 128, 4, 4, split_k=2),
    "DOT 64x128 w4 s4 split 4": LinearTile(64, 128, 4, 4, split_k=4),
    "DOT 32x128 w4 s4 split 4": LinearTile(32, 128, 4, 4, split_k=4),
    "DOT 128x64 w4 s4 split 4": LinearTile(128, 64, 4, 4, split_k=4),
    "DOT 64x64 w4 s4 split 8": LinearTile(64, 64, 4, 4, split_k=8),
    "DOT 32x256 w4 s3 split 2": LinearTile(32, 256, 4, 3, split_k=2),
}


class WideVariant(NamedTuple):
    in_tile: LinearTile | None = None  # None: skinny_linear_triton.DOT_TILE
    out_tile: LinearTile | None = None  # None: out_proj_add_triton.WIDE_TILE
    fused: bool = True  # in_proj's conv in its epilogue (forced at any rows), or its own launch (session 18)
    pdl: bool = True  # False: every kernel launched without PDL (PD_SSM_PDL=0 while the graph is captured)
    parts: str = "all"  # or "no state update" / "state update only" / "no conv" / "no conv, no state update"
    early_block_m: int = 0  # in_proj_conv's EARLY_TAPS_BLOCK_M while the graph is captured (0: its own)
    ssu: SSUConfig | None = None  # the gated state update's tile (None: mixer_decode_triton.default_config)


PENDING_VARIANTS: dict[str, WideVariant] = {
    "pending, conv launch (session 18)": WideVariant(fused=False),
    "pending, conv in in_proj": WideVariant(),
    "pending, conv in in_proj, early taps from 16 rows": WideVariant(early_block_m=16),
    "pending, conv launch, no PDL": WideVariant(fused=False, pdl=False),
    "pending, conv in in_proj, no PDL": WideVariant(pdl=False),
    "pending, no state update": WideVariant(parts="no state update"),
    "pending, state update only": WideVariant(parts="state update only"),
    # columns-first tiles since session 20 (64 columns: the wgmma's M); the defaults are in 32, out 64
    # split 4. The GEMMs alone over tiles:
    "GEMMs, in 64 cols": WideVariant(in_tile=LinearTile(64, 128, 4, 4), parts="no state update"),
    "GEMMs, in 64 cols s3": WideVariant(in_tile=LinearTile(64, 128, 4, 3), parts="no state update"),
    "GEMMs, in 128 cols k64 s6": WideVariant(in_tile=LinearTile(128, 64, 4, 6), parts="no state update"),
    "GEMMs, out 32 cols split 4": WideVariant(out_tile=LinearTile(32, 128, 4, 4, split_k=4), parts="no state update"),
    "GEMMs, out 64 cols split 2": WideVariant(out_tile=LinearTile(64, 128, 4, 4, split_k=2), parts="no state update"),
    "GEMMs, out 64 cols split 8": WideVariant(out_tile=LinearTile(64, 128, 4, 4, split_k=8), parts="no state update"),
    # the whole chain over tiles
    "pending, in 64": WideVariant(in_tile=LinearTile(64, 128, 4, 4)),
    "pending, in 128 k64 s6": WideVariant(in_tile=LinearTile(128, 64, 4, 6)),
    "pending, out 32 split 4": WideVariant(out_tile=LinearTile(32, 128, 4, 4, split_k=4)),
    "pending, out 64 split 8": WideVariant(out_tile=LinearTile(64, 128, 4, 4, split_k=8)),
    # the gated state update's tile (default at 8+ rows: 16 headdim rows, 2 warps)
    "pending, state update 8 rows w1": WideVariant(ssu=SSUConfig(8, 1)),
    "pending, state update 8 rows w2": WideVariant(ssu=SSUConfig(8, 2)),
    "pending, state update 16 rows w1": WideVariant(ssu=SSUConfig(16, 1)),
    "pending, state update 16 rows w4": WideVariant(ssu=SSUConfig(16, 4)),
    "pending, state update 32 rows w2": WideVariant(ssu=SSUConfig(32, 2)),
    "pending, state update 32 rows w4": WideVariant(ssu=SSUConfig(32, 4)),
    "pending, state update 64 rows w4": WideVariant(ssu=SSUConfig(64, 4)),
    # what the conv costs where it is: in_proj's GEMM alone (the state update on a fixed conv output)
    "pending, no conv": WideVariant(parts="no conv"),
    "GEMMs, no conv": WideVariant(parts="no conv, no state update"),
}


def pending_part(out: Path) -> None:
    """Part 2 (module docstring): µs per layer, variants alternating, two rounds."""
    results: list[dict[str, Any]] = []
    profiled = os.environ.get("WIDE_PROFILE", "").split(";")  # variants whose kernels are profiled in round 0
    for rows in (int(r) for r in os.environ.get("WIDE_ROWS", "8,32").split(",")):
        chain = Wide(torch.device("cuda"), rows)
        want: torch.Tensor | None = None
        for rnd in range(2):
            only = os.environ.get("WIDE_VARIANTS")  # a ";"-separated subset of the pending variants
            chosen = {k: v for k, v in PENDING_VARIANTS.items() if not only or k in only.split(";")}
            for name, v in {"norm launch, cuBLAS": None, **chosen}.items():
                try:
                    got, us = (time_chain(chain, chain.run, None) if v is None
                               else time_chain(chain, chain.run_pending, v))
                except Exception as e:  # noqa: BLE001 -- a variant that fails to compile or capture is reported
                    print(f"{rows:3} rows {name:54} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                want = got if want is None else want
                # NOTE: nan for the partial chains (another output)
                rel = float((got - want).norm() / want.norm()) if got.shape == want.shape else float("nan")
                results.append({"rows": rows, "variant": name, "round": rnd, "us_per_layer": us, "rel_diff": rel})
                print(f"{rows:3} rows {name:54} round {rnd} {us:7.2f} us/layer  residual rel diff {rel:.2e}",
                      flush=True)
                if rnd == 0 and name in profiled and v is not None:
                    results[-1]["kernels"] = profile_replay(chain, chain.run_pending, v)
        del chain
        torch.cuda.empty_cache()
    (out / "wide_pending.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if os.environ.get("WIDE_PENDING") == "1":
        pending_part(out)
        return
    chain = Wide(torch.device("cuda"))
    results: list[dict[str, Any]] = []
    want: torch.Tensor | None = None
    for rnd in range(2):
        for name, tile in TILES.items():
            try:
                got, us = time_chain(chain, chain.run, tile)
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
