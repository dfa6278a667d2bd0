"""Where an eager SSD scan call's time goes: host (launcher) against device, ours and mamba_ssm's.

On the GPU machine, from the repository root (third_party carried):

    pip install -q --no-index --no-deps --target /tmp/site third_party/wheels/einops*.whl
    PYTHONPATH=.:third_party/baseline:/tmp/site python3 benchmarks/ssd_host_gpu.py

Per case and variant (ssd_sweep_gpu.py's inputs and variants, by name in SSD_HOST_VARIANTS): eager do_bench median (what the
sweep reports), CUDA-graph replay (device time alone), and host time a call (calls issued behind
a long `torch.cuda._sleep`, so the queue never drains and the loop's wall time is the host's);
with SSD_HOST_KERNELS=1 each kernel's device time (torch.profiler).
Then cProfile of ours at 1 x 8192, the top functions by own time. Writes $OUT/ssd_host.json.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time
from dataclasses import replace
from typing import Any

sys.argv = [sys.argv[0]]  # the sweep module parses its own options at import
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ssd_sweep_gpu as sw  # noqa: E402
import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

# variants of ssd_sweep_gpu.py by name (SSD_HOST_VARIANTS, comma-separated)
VARIANTS: dict[str, dict[str, Any]] = {
    k: sw.VARIANTS_ALL[k] for k in os.environ.get("SSD_HOST_VARIANTS", "default,q128 serial,q64 serial").split(",")
}
_CASES = {"1x2048": ([2048], "fresh"), "1x8192": ([8192], "fresh"), "16x1024 unaligned": ([1024] * 16, "unaligned"),
          "1x32768": ([32768], "fresh"), "16x1024 aligned": ([1024] * 16, "aligned"),
          "8x1024 unaligned": ([1024] * 8, "unaligned"), "32x256 unaligned": ([256] * 32, "unaligned"),
          "64x128 unaligned": ([128] * 64, "unaligned")}
# cases by name (SSD_HOST_CASES, comma-separated; the first four by default); SSD_HOST_BASELINE=0
# leaves mamba_ssm out and SSD_HOST_PROFILE=0 the cProfile (an A/B of two trees needs neither)
CASES = {k: _CASES[k] for k in os.environ.get("SSD_HOST_CASES", ",".join(list(_CASES)[:4])).split(",")}
BASELINE = os.environ.get("SSD_HOST_BASELINE", "1") == "1"
PROFILE = os.environ.get("SSD_HOST_PROFILE", "1") == "1"
KERNELS = os.environ.get("SSD_HOST_KERNELS", "0") == "1"  # each kernel's device time too (torch.profiler)


def host_us(fn: Any, sets: list[Any], calls: int = 30) -> float:
    """Host microseconds a call, measured while the device is busy sleeping."""
    fn(sets[0])
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s at 1.98 GHz: far longer than the calls below take to issue
    t = time.perf_counter()
    for k in range(calls):
        fn(sets[k % len(sets)])
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / calls * 1e6


def graph_ms(fn: Any, sets: list[Any]) -> float:
    graphs = []
    for s in sets[:4]:
        fn(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(s)
        graphs.append(g)
    k = [0]

    def step() -> None:
        graphs[k[0] % len(graphs)].replay()
        k[0] += 1

    return do_bench(step, warmup=10, rep=40, return_mode="median")


def kernel_us(fn: Any, sets: list[Any], calls: int = 10) -> dict[str, float]:
    """Device microseconds a call, per kernel (by name), from torch.profiler over `calls` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn(sets[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for k in range(calls):
            fn(sets[k % len(sets)])
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:60]] = times.get(e.name[:60], 0.0) + e.device_time / calls
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    res: dict[str, Any] = {}
    for name, (lengths, mode) in CASES.items():
        sets = sw.rotating(lengths, mode)
        row: dict[str, Any] = {}
        for vname, over in VARIANTS.items():
            over = dict(over)
            q = over.pop("_chunk", sw.Q)
            cfg = replace(sw.default_config(torch.bfloat16, sum(lengths)), **over)

            def fn(s: Any, cfg: Any = cfg, q: int = q) -> Any:
                return sw.ours(s, cfg, q=q)

            row[vname] = dict(eager_ms=sw.bench(fn, sets), graph_ms=graph_ms(fn, sets), host_us=host_us(fn, sets))
            if KERNELS:
                row[vname]["kernel_us"] = kernel_us(fn, sets)
            sw.log(name, vname, row[vname])
        if sw.mamba_chunk_scan_combined is not None and BASELINE:
            row["mamba_ssm"] = dict(eager_ms=sw.bench(sw.mamba, sets), host_us=host_us(sw.mamba, sets))
            try:  # its device time alone, where its call can be captured
                row["mamba_ssm"]["graph_ms"] = graph_ms(sw.mamba, sets)
            except Exception as e:  # noqa: BLE001
                row["mamba_ssm"]["graph_error"] = repr(e)[:200]
                torch.cuda.synchronize()
            sw.log(name, "mamba_ssm", row["mamba_ssm"])
        res[name] = row
        del sets
        torch.cuda.empty_cache()
    json.dump(res, open(f"{out_dir}/ssd_host.json", "w"), indent=1)
    if not PROFILE:
        return
    sets = sw.rotating([8192], "fresh")
    for vname in list(VARIANTS)[:2]:
        over = dict(VARIANTS[vname])
        q = over.pop("_chunk", sw.Q)
        cfg = replace(sw.default_config(torch.bfloat16, 8192), **over)
        for k in range(3):
            sw.ours(sets[k % len(sets)], cfg, q=q)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)
        prof = cProfile.Profile()
        prof.enable()
        for k in range(30):
            sw.ours(sets[k % len(sets)], cfg, q=q)
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(28)
        print(f"--- cProfile, 30 calls, {vname} at 1x8192 ---\n" + buf.getvalue()[-6000:])


if __name__ == "__main__":
    main()
