"""The batch-1 decode step's layer chain as the engine runs it, in one CUDA graph under PDL: the block
boundary with its own norm launch against the boundary folded into out_proj and in_proj
(kernels/pending_norm.py), and the in_proj GEMV's tile.

Mamba2-2.7B shape (d_model 2560, 80 heads x 64, dstate 128, one group, conv width 4), bf16, fp32
state, fp32 residual stream, one sequence, 64 layers each on its own weights and pools (5.1 GB of
weights, far past L2). Per layer:

  norm launch     add_rms_norm (residual add, the deferred gated-norm scale) -> in_proj + conv
                  -> state update + gate -> out_proj                          (main before session 18)
  pending norm    in_proj + conv on the pending norm -> state update + gate -> out_proj + residual add
                  (main since session 18), and other state update and out_proj tiles

µs per layer (median of 7 replays of the whole chain) and the bytes that must move (weights + state
read and written) over that time. Each variant's last residual is compared with the first
variant's (the pending norm rounds differently: close, not equal).

    PYTHONPATH=. python3 benchmarks/decode_chain_gpu.py     (CUDA only; JSON to $OUT/decode_chain.json)
    CHAIN_VARIANTS="norm launch;pending norm" CHAIN_ROUNDS=3 ...   (those variants only, three rounds)
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

import pd_ssm.kernels.in_proj_conv_triton as in_proj_conv_mod
import pd_ssm.kernels.mixer_decode_triton as mixer_decode_mod
import pd_ssm.kernels.out_proj_add_triton as out_proj_add_mod
from benchmarks.decode_layers import (
    D_INNER,
    EPS,
    HID,
    PROJ,
    DecodeLayers,
    G,
    H,
    N,
    P,
    profile_replay,
    time_chain,
)
from pd_ssm.kernels.in_proj_conv_triton import in_proj_conv_triton
from pd_ssm.kernels.mixer_decode_triton import default_config, launch_decode_step
from pd_ssm.kernels.out_proj_add_triton import out_proj_add_triton
from pd_ssm.kernels.pending_norm import PendingNorm
from pd_ssm.kernels.rmsnorm import RowRms
from pd_ssm.kernels.rmsnorm_triton import add_rms_norm_triton
from pd_ssm.kernels.skinny_linear_triton import FMA_TILE, FMA_TILE_NARROW, LinearTile, skinny_linear_triton
from pd_ssm.kernels.ssu_triton import SSUConfig

L = 64


class Variant(NamedTuple):
    name: str
    pending: bool
    in_tile: LinearTile | None = None  # None: in_proj_conv_triton's own (the tile balanced over the SMs)
    out_tile: LinearTile = FMA_TILE_NARROW
    ssu: SSUConfig | None = None  # None: mixer_decode_triton.default_config
    plain: tuple[str, ...] = ()  # of PLAIN_MODULES: those kernels launched without the PDL attribute


# NOTE: a kernel compiled with its gate but launched without the PDL attribute starts after its
# predecessor completes (the gate returns at once) and still releases its dependents early
PLAIN_MODULES = {"in_proj": in_proj_conv_mod, "ssu": mixer_decode_mod, "out_proj": out_proj_add_mod}


@contextlib.contextmanager
def plain_launches(names: tuple[str, ...]) -> Iterator[None]:
    """Within: the named kernels launch without the PDL attribute (their modules' launch_options)."""
    saved = {n: PLAIN_MODULES[n].launch_options for n in names}
    try:
        for n in names:
            PLAIN_MODULES[n].launch_options = lambda pdl: {}  # type: ignore[attr-defined]
        yield
    finally:
        for n, f in saved.items():
            PLAIN_MODULES[n].launch_options = f  # type: ignore[attr-defined]


class Chain(DecodeLayers):
    """L layers at one sequence; `run` is one decode step's layers."""

    def __init__(self, dev: torch.device) -> None:
        super().__init__(L, 1, dev)
        self.residual = self.rand(1, HID, dtype=torch.float32)
        self.delta = self.rand(1, HID)
        self.sq = torch.rand(1, 4 * H, device=dev) * D_INNER / (4 * H)
        self.cfg = default_config(1, P, N, torch.float32)

    def run(self, v: Variant, _: int = 0) -> torch.Tensor:
        with plain_launches(v.plain):
            return self._run(v)

    def _run(self, v: Variant) -> torch.Tensor:
        x_rms = RowRms(self.sq, D_INNER, EPS)
        # layer 0's norm runs as its own launch in both: the embedding has no out_proj before it
        normed, residual = add_rms_norm_triton(self.delta, self.residual, self.norm_w[0], EPS,
                                               residual_dtype=torch.float32, x_rms=x_rms)
        hidden: torch.Tensor | PendingNorm = normed
        delta = self.delta
        for i in range(L):
            if i and not v.pending:
                hidden, residual = add_rms_norm_triton(delta, residual, self.norm_w[i], EPS,
                                                       residual_dtype=torch.float32, x_rms=x_rms)
            proj, xbc = in_proj_conv_triton(hidden, self.w_in[i], None, self.conv[i], self.cw, self.cb,
                                            state_indices=self.slots, conv_start=D_INNER, tile=v.in_tile)
            gs = launch_decode_step(proj, self.conv[i], self.cw, self.cb, self.ssm[i], self.A, self.D,
                                    self.dt_bias, self.gate_w, self.slots, G, v.ssu or self.cfg, xbc)
            x_rms = RowRms(gs.sq, D_INNER, EPS)
            if v.pending:
                residual, hidden = out_proj_add_triton(gs.g, self.w_out[i], x_rms, residual, self.norm_w[(i + 1) % L],
                                                       EPS, residual_dtype=torch.float32, tile=v.out_tile)
            else:
                delta = skinny_linear_triton(gs.g, self.w_out[i], tile=v.out_tile)
        # norm_f: the add and the norm, or the norm alone where out_proj did the add
        if v.pending:
            return add_rms_norm_triton(None, residual, self.norm_w[0], EPS, residual_dtype=torch.float32).residual
        return add_rms_norm_triton(delta, residual, self.norm_w[0], EPS, residual_dtype=torch.float32,
                                   x_rms=x_rms).residual


def variants() -> list[Variant]:
    out = [Variant("norm launch", False), Variant("pending norm", True)]
    for bp, w in ((8, 4), (8, 2), (4, 2), (16, 2), (32, 4)):
        out.append(Variant(f"pending norm, state update {bp} rows w{w}", True, ssu=SSUConfig(bp, w)))
    for t in (LinearTile(4, 1024, 4, 3, prefetch_k=2048), LinearTile(8, 512, 4, 4, prefetch_k=2048),
              LinearTile(4, 512, 4, 4, prefetch_k=1024), LinearTile(4, 512, 4, 4, prefetch_k=4096)):
        tag = f"out_proj {t.block_n}x{t.block_k} s{t.num_stages} pre {t.prefetch_k}"
        out.append(Variant(f"pending norm, {tag}", True, out_tile=t))
    for plain in (("in_proj",), ("ssu",), ("out_proj",), ("in_proj", "out_proj"), ("in_proj", "ssu", "out_proj")):
        out.append(Variant(f"pending norm, plain {'+'.join(plain)}", True, plain=plain))
    for t in (LinearTile(16, 256, 4, 3), LinearTile(16, 512, 4, 3), LinearTile(64, 128, 4, 3)):
        tag = f"in_proj {t.block_n}x{t.block_k} s{t.num_stages}"
        out.append(Variant(f"pending norm, {tag}", True, in_tile=t))
        out.append(Variant(f"pending norm, {tag}, plain in_proj", True, in_tile=t, plain=("in_proj",)))
    # LinearTile.cols: programs owning fewer columns than their tile, the grid a whole number a SM (the
    # default since session 22: 27 columns, 392 programs on 132 SMs); FMA_TILE itself is 331 of 32
    for t in (FMA_TILE, FMA_TILE._replace(cols=21), LinearTile(64, 256, 4, 3, cols=41)):
        out.append(Variant(f"pending norm, in_proj {t.block_n}x{t.block_k} cols {t.cols or t.block_n}", True, in_tile=t))
    for t in (LinearTile(8, 512, 4, 4, prefetch_k=2048, cols=5), LinearTile(8, 512, 4, 4, prefetch_k=2048, cols=7),
              LinearTile(4, 512, 4, 4, prefetch_k=2048, cols=3), LinearTile(16, 512, 4, 4, prefetch_k=1024, cols=10)):
        out.append(Variant(f"pending norm, out_proj {t.block_n}x{t.block_k} pre {t.prefetch_k} cols {t.cols}", True,
                           out_tile=t))
    out += [Variant("norm launch (again)", False), Variant("pending norm (again)", True)]
    only = os.environ.get("CHAIN_VARIANTS")  # a ";"-separated subset of the names, for A/B calls
    return out if not only else [v for v in out if v.name in only.split(";")]


PROFILED = ("norm launch", "pending norm")


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    chain = Chain(dev)
    moved = (PROJ * HID + HID * D_INNER) * 2 + 2 * H * P * N * 4  # bytes a layer: weights + state r/w
    results: list[dict[str, Any]] = []
    first: torch.Tensor | None = None
    done: set[str] = set()  # variants profiled (once)
    rounds = int(os.environ.get("CHAIN_ROUNDS", "1"))  # the variant list run this many times, interleaved
    for v in variants() * rounds:
        try:
            got, us = time_chain(chain, chain.run, v)
        except Exception as e:  # noqa: BLE001 -- a variant that fails to compile or capture is reported
            print(f"{v.name:52} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            results.append({"variant": v.name, "error": str(e)[:1000]})
            continue
        first = got if first is None else first
        rel = float((got - first).norm() / first.norm())
        row = {"variant": v.name, "us_per_layer": us, "gbps": moved / us / 1e3, "rel_diff_to_first": rel}
        results.append(row)
        print(f"{v.name:52} {us:7.2f} us/layer  {row['gbps']:6.0f} GB/s  residual rel diff {rel:.2e}", flush=True)
        if v.name in PROFILED and v.name not in done:
            done.add(v.name)
            row["kernels"] = profile_replay(chain, chain.run, v)
    (out / "decode_chain.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
