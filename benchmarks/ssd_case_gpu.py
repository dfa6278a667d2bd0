"""SSD cases of benchmarks/ssd_sweep_gpu.py for a profiler: each kernel's time (torch.profiler) under the
default config and config variants, or a few plain launches for ncu.

    PYTHONPATH=. python3 benchmarks/ssd_case_gpu.py --cases 16x1024,64x128 [--mode mid] [--calls 20] \
        [--variants "bn32:serial_block_n=32;bk128 w8:serial_block_k=128,serial_warps=8"]
    PYTHONPATH=. ncu --clock-control none -k regex:_ssd_state_serial --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python3 benchmarks/ssd_case_gpu.py --cases 16x1024 --ncu

A case SxT is S sequences of T tokens (Mamba2-2.7B shapes, bf16, fp32 pool); --mode fresh | aligned
| mid (histories, as the sweep's cases). The default is what a launch without a config runs
(`default_config(bf16, tokens)`); a variant replaces SSDConfig fields of it. Each variant's output
and pool are compared with the default's first (rel err; a variant that only moves work between
programs gives the same bits). Prints each kernel's median µs a call and their sum.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections import defaultdict
from typing import Any

import torch

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--cases", default="16x1024")
ARGS.add_argument("--mode", default="mid", choices=("fresh", "aligned", "mid"))
ARGS.add_argument("--calls", type=int, default=20)
ARGS.add_argument("--variants", default="", help='"name:field=value,field=value;name:..." over the default')
ARGS.add_argument("--ncu", action="store_true", help="five plain calls of the default, nothing timed")
ARGS.add_argument("--tiny", action="store_true", help="the sweep's tiny shapes (CPU, TRITON_INTERPRET=1: a smoke test)")
OPTS = ARGS.parse_args()
sys.argv = sys.argv[:1] + (["--tiny"] if OPTS.tiny else [])  # ssd_sweep_gpu parses its own arguments when imported
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.ssd_sweep_gpu import make_inputs, ours, rel  # noqa: E402
from pd_ssm.kernels.ssd_config import SSDConfig, default_config  # noqa: E402


def variant(base: SSDConfig, spec: str) -> SSDConfig:
    """base with the fields of `spec` ("field=value,...") replaced, each parsed as its field's type."""
    kinds = {f.name: f.type for f in dataclasses.fields(SSDConfig)}
    changes: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        kind = kinds.get(name)
        if kind is None:
            raise SystemExit(f"ssd_case_gpu: SSDConfig has no field {name!r}")
        changes[name] = (value == "True" if "bool" in str(kind) else int(value) if "int" in str(kind)
                         else float(value) if "float" in str(kind) else value)
    return dataclasses.replace(base, **changes)


def kernel_times(inp: Any, cfg: SSDConfig) -> dict[str, float]:
    """Each kernel's median µs a call over OPTS.calls eager calls (none off CUDA: --tiny checks only)."""
    if not torch.cuda.is_available():
        return {}
    for _ in range(3):
        ours(inp, cfg)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(OPTS.calls):
            ours(inp, cfg)
        torch.cuda.synchronize()
    times: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name].append(e.device_time)
    return {name: sorted(ts)[len(ts) // 2] * len(ts) / OPTS.calls for name, ts in times.items()}


def main() -> None:
    for case in OPTS.cases.split(","):
        S, T = (int(v) for v in case.split("x"))
        inp = make_inputs([T] * S, OPTS.mode, seed=0)
        base = default_config(torch.bfloat16, S * T)  # what a launch without a config runs
        if OPTS.ncu:
            for _ in range(5):
                ours(inp, base)
            torch.cuda.synchronize()
            continue
        pool0 = inp.pool.clone()
        ref_out = ours(inp, base).out.clone()
        ref_pool = inp.pool.clone()
        specs = [("default", "")] + [tuple(v.split(":", 1)) for v in filter(None, OPTS.variants.split(";"))]
        for name, spec in specs:
            cfg = variant(base, spec)
            inp.pool.copy_(pool0)
            out = ours(inp, cfg).out
            err = f"out {rel(out, ref_out):.1e} pool {rel(inp.pool, ref_pool):.1e}"
            times = kernel_times(inp, cfg)
            for kname, us in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"{case} {OPTS.mode} [{name}]: {kname[:40]:40s} {us:8.1f} us", flush=True)
            print(f"{case} {OPTS.mode} [{name}]: {'TOTAL':40s} {sum(times.values()):8.1f} us  ({err})", flush=True)


if __name__ == "__main__":
    main()
