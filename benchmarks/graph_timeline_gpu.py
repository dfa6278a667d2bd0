"""Where a decode step replayed from a CUDA graph spends its time, kernel by kernel, with PDL overlap
counted: the Mamba2-2.7B shape, dummy weights, bf16, fp32 state, at batch 1 and 32 (TIMELINE_BATCHES: any
batches up to 32).

An eager profile (profile_engine_gpu.py) gives each kernel's own duration; inside a graph with
programmatic dependent launch the kernels overlap, so their durations do not add up to the step.
Here every kernel of the profiled replays is attributed the wall time it adds: its end minus the
latest end of every kernel before it (0 if it ends inside one), and the GPU's idle time before it
(its start minus that latest end, where positive). The attributions sum to the profiled window.
Per kernel name: launches per step, mean own duration, mean attributed time, mean idle before it.

Then where the GPU idles before each replayed graph (13.6-18.2 us a step, session 21): per replay,
the host's cudaGraphLaunch call (start, end) against the last GPU kernel before the graph and the
graph's first kernel (the trace's correlation ids tie a launch to its kernels); if the host ends
its launch call before the GPU has drained, the idle is the GPU's own graph start.

    PYTHONPATH=. [TIMELINE_BATCHES=1,8,32] python3 benchmarks/graph_timeline_gpu.py
    (CUDA only; $OUT/graph_timeline.{json,txt})
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_engine_gpu import eager_engine_2_7b  # noqa: E402

from pd_ssm.sampling_params import SamplingParams  # noqa: E402

STEPS = 6


def trace_events(prof: Any) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return list(json.loads(path.read_text())["traceEvents"])


def kernels_of(events: list[dict[str, Any]]) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every GPU kernel in the trace, by start."""
    out = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"][:80])
           for e in events if e.get("cat") == "kernel" and "dur" in e]
    return sorted(out)


def graph_starts(events: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per cudaGraphLaunch: its host call's start and end, the end of the last GPU op (kernel or copy)
    before the graph's first kernel and that first kernel's start (µs, one clock)."""
    # NOTE: copies count as GPU work here (a host->device copy may be what the graph waits behind)
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("args", {}).get("correlation"))
                     for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    out = []
    for e in events:
        if e.get("cat") != "cuda_runtime" or "GraphLaunch" not in e.get("name", ""):
            continue
        corr = e.get("args", {}).get("correlation")
        mine = [k for k in kernels if k[2] == corr]
        if not mine:
            continue
        first = mine[0][0]
        before = [k[1] for k in kernels if k[0] < first and k[2] != corr]
        out.append({"launch_start": float(e["ts"]), "launch_end": float(e["ts"]) + float(e["dur"]),
                    "prev_kernel_end": max(before) if before else float("nan"), "first_kernel_start": first})
    return out


def attribute(kernels: list[tuple[float, float, str]], steps: int) -> list[dict[str, Any]]:
    """Per kernel name: launches, own µs, attributed µs and idle µs before it, all per step."""
    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    latest = kernels[0][0] if kernels else 0.0
    for start, end, name in kernels:
        a = agg[name]
        a[0] += 1
        a[1] += end - start
        a[2] += max(0.0, end - max(latest, start))
        a[3] += max(0.0, start - latest)
        latest = max(latest, end)
    rows = [{"kernel": k, "launches": v[0] / steps, "own_us": v[1] / steps, "attributed_us": v[2] / steps,
             "idle_before_us": v[3] / steps} for k, v in agg.items()]
    return sorted(rows, key=lambda r: -(r["attributed_us"] + r["idle_before_us"]))


def boundary_ops(events: list[dict[str, Any]]) -> list[str]:
    """The GPU ops (kernels, copies, memsets) from the last graph's lm_head... to the next graph's third
    kernel: category, start µs from the first listed op's end, duration µs, name."""
    ops = sorted((float(e["ts"]), float(e["dur"]), e.get("cat", ""), e.get("name", "")[:60])
                 for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    heads = [i for i, o in enumerate(ops) if o[2] == "kernel" and "nvjet" in o[3] and "384x" in o[3]]
    if len(heads) < 3:
        return []
    i = heads[-2]
    t0 = ops[i][0] + ops[i][1]
    out = []
    for ts, dur, cat, name in ops[i: i + 12]:
        out.append(f"    {cat:11s} {ts - t0:8.1f} {dur:7.1f}  {name}")
    return out

BATCHES = [int(b) for b in os.environ.get("TIMELINE_BATCHES", "1,32").split(",")]


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    engine = eager_engine_2_7b(max_num_seqs=32, enforce_eager=False)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    report: dict[str, Any] = {}
    lines: list[str] = []
    for batch in BATCHES:
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, detokenize=False, output_kind="delta")
        ids = [engine.add_request(torch.randint(1, vocab, (16,), generator=gen).tolist(), params).req_id
               for _ in range(batch)]
        for _ in range(8):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                engine.step()
            torch.cuda.synchronize()
        ks = kernels_of(trace_events(prof))
        # NOTE: a second window with the host's calls traced too (host time grows under the profiler)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                engine.step()
            torch.cuda.synchronize()
        cpu_events = trace_events(prof)
        starts = graph_starts(cpu_events)
        rows = attribute(ks, STEPS)
        window = (max(e for _, e, _ in ks) - ks[0][0]) / STEPS if ks else 0.0
        total_idle = sum(r["idle_before_us"] for r in rows)
        report[f"decode_{batch}"] = {"window_us_per_step": window, "idle_us_per_step": total_idle, "kernels": rows,
                                     "graph_starts": starts}
        lines.append(f"decode batch {batch} (graph replay): {window:.1f} us a step in the window, GPU idle "
                     f"{total_idle:.1f} us; per step: launches, own us, attributed us, idle before us")
        lines += [f"  x{r['launches']:5.0f} {r['own_us']:8.1f} {r['attributed_us']:8.1f} {r['idle_before_us']:7.1f}  "
                  f"{r['kernel']}" for r in rows[:14]]
        lines.append("  graph starts (µs from the GPU's last kernel before the graph): host launch call start / "
                     "end, the graph's first kernel")
        lines += [f"    {g['launch_start'] - g['prev_kernel_end']:9.1f} {g['launch_end'] - g['prev_kernel_end']:9.1f} "
                  f"{g['first_kernel_start'] - g['prev_kernel_end']:9.1f}" for g in starts]
        lines.append("  the ops of one step boundary (category, µs from the lm_head's end, duration µs, name):")
        lines += boundary_ops(cpu_events)
        for r in ids:
            engine.abort(r)
    (out / "graph_timeline.json").write_text(json.dumps(report, indent=1))
    (out / "graph_timeline.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
