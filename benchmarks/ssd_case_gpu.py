"""One SSD case of benchmarks/ssd_sweep_gpu.py, for a profiler: each kernel's time (torch.profiler), or a
few plain launches for ncu.

    PYTHONPATH=. python3 benchmarks/ssd_case_gpu.py --case 16x1024 [--mode mid] [--calls 20]
    PYTHONPATH=. ncu --clock-control none -k regex:_ssd_state_serial --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python3 benchmarks/ssd_case_gpu.py --case 16x1024 --ncu

--case SxT: S sequences of T tokens (Mamba2-2.7B shapes, bf16, fp32 pool); --mode fresh | aligned | mid
(histories, as the sweep's cases). Prints the kernels' median µs a call.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--case", default="16x1024")
ARGS.add_argument("--mode", default="mid", choices=("fresh", "aligned", "mid"))
ARGS.add_argument("--calls", type=int, default=20)
ARGS.add_argument("--ncu", action="store_true", help="five plain calls, nothing timed")
OPTS = ARGS.parse_args()
sys.argv = sys.argv[:1]  # ssd_sweep_gpu parses its own arguments when imported
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.ssd_sweep_gpu import make_inputs, ours  # noqa: E402
from pd_ssm.kernels.ssd_config import default_config  # noqa: E402


def main() -> None:
    S, T = (int(v) for v in OPTS.case.split("x"))
    inp = make_inputs([T] * S, OPTS.mode, seed=0)
    cfg = default_config(torch.bfloat16, S * T)  # what a launch without a config runs
    if OPTS.ncu:
        for _ in range(5):
            ours(inp, cfg)
        torch.cuda.synchronize()
        return
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
    for name, ts in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        ts.sort()
        print(f"{OPTS.case} {OPTS.mode}: {name[:60]:60s} {ts[len(ts) // 2]:8.1f} us x{len(ts) / OPTS.calls:.0f}",
              flush=True)


if __name__ == "__main__":
    main()
