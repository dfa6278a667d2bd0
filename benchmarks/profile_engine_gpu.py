"""Where a whole-model step spends its time on the GPU: per-kernel CUDA time of one prefill step and
of eager decode steps (torch.profiler), beside the step's wall time, for a real shape
(bench/shapes.py, Mamba2-2.7B by default) with dummy weights.  Eager decode shows each kernel's own
duration; the graph replay time of the same batch (from `pd-ssm bench engine`) minus their sum is
what the graph's node gaps cost.

    python benchmarks/profile_engine_gpu.py [--out DIR] [--shape NAME] [--context N] [--graphs]
    (CUDA only; writes profile.json, .txt)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from pd_ssm.bench.engine import decode_max_tokens, finish_prefills
from pd_ssm.bench.shapes import MAMBA2_2_7B, SHAPES
from pd_ssm.config import CacheConfig, EngineConfig, SchedulerConfig
from pd_ssm.engine.engine import Engine
from pd_ssm.sampling_params import SamplingParams


def kernel_table(prof: Any, steps: int) -> list[dict[str, Any]]:
    """CUDA kernels grouped by name: total us per step, launches per step, mean us per launch."""
    agg: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            agg[ev.name[:90]].append(ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total)
    rows = [
        {"kernel": k, "us_per_step": sum(v) / steps, "launches_per_step": len(v) / steps,
         "us_per_launch": sum(v) / len(v)}
        for k, v in agg.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def eager_engine_2_7b(max_num_seqs: int, *, enforce_eager: bool = True,
                      shape: dict[str, Any] = MAMBA2_2_7B) -> Engine:
    """A CUDA engine of the Mamba2-2.7B shape (or `shape`): dummy bf16 weights, fp32 state,
    2048-token steps; eager unless enforce_eager is False (decode steps then replay CUDA graphs)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(shape))
        return Engine(EngineConfig(
            model=tmp, device="cuda", dtype="bfloat16", load_format="dummy", enforce_eager=enforce_eager,
            cache=CacheConfig(mamba_ssm_cache_dtype="float32"),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
        ))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--graphs", action="store_true",
                    help="steps replay their CUDA graphs (default: eager, each kernel profiled by itself)")
    ap.add_argument("--shape", default="mamba2-2.7b", choices=list(SHAPES))
    ap.add_argument("--context", type=int, default=16, help="prompt tokens of each decode request")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = eager_engine_2_7b(max_num_seqs=128, shape=SHAPES[args.shape], enforce_eager=not args.graphs)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    report: dict[str, Any] = {}
    lines: list[str] = []

    def prompt(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    # prefill: wall of the whole step, then a profiled one
    walls = []
    for i in range(6):
        engine.add_request(prompt(2048), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        if i >= 2:
            walls.append(1e3 * (time.perf_counter() - t0))
    engine.add_request(prompt(2048), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        engine.step()
        torch.cuda.synchronize()
    rows = kernel_table(prof, 1)
    busy = sum(r["us_per_step"] for r in rows) / 1e3
    report["prefill"] = {"wall_ms": statistics.median(walls), "kernel_ms": busy, "kernels": rows}
    lines.append(f"prefill 2048: wall {statistics.median(walls):.2f} ms, kernel sum {busy:.2f} ms, "
                 f"{sum(r['launches_per_step'] for r in rows):.0f} launches")
    lines += [f"  {r['us_per_step']:9.1f} us  x{r['launches_per_step']:5.0f}  {r['kernel']}" for r in rows[:25]]

    for batch in (1, 32, 128):
        # 6 warm-up, 10 timed and 5 profiled steps after the last prompt's prefill
        params = SamplingParams(temperature=0, max_tokens=decode_max_tokens(batch, args.context, 2048, 30),
                                ignore_eos=True)
        ids = [engine.add_request(prompt(args.context), params).req_id for _ in range(batch)]
        finish_prefills(engine)
        for _ in range(6):
            engine.step()
        walls = []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            walls.append(1e3 * (time.perf_counter() - t0))
        steps = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        rows = kernel_table(prof, steps)
        busy = sum(r["us_per_step"] for r in rows) / 1e3
        report[f"decode_{batch}"] = {"eager_wall_ms": statistics.median(walls), "kernel_ms": busy, "kernels": rows}
        mode = "graphs" if args.graphs else "eager"
        lines.append(f"decode batch {batch} ({mode}): wall {statistics.median(walls):.2f} ms/step, kernel sum "
                     f"{busy:.2f} ms, {sum(r['launches_per_step'] for r in rows):.0f} launches/step")
        lines += [f"  {r['us_per_step']:9.1f} us  x{r['launches_per_step']:5.0f}  {r['kernel']}" for r in rows[:20]]
        for r in ids:
            engine.abort(r)
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    (out / "profile.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
