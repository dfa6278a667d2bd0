"""Where a served workload's first seconds go, without HTTP: the engine of one `pd-ssm serve` worker
(Mamba2-2.7B shape, dummy weights, the flags of benchmarks/serve_gpu.sh) fed the same
workload in-process (bench serve's: Poisson arrivals, random prompt ids, ignore_eos), every step timed.

    python benchmarks/serve_steps_gpu.py [--rate 8] [--prompts 64] [--input-len 1024] [--output-len 128]
        [--profile FILE]   (cProfile of the whole run, top functions by cumulative time into FILE)

Prints each step longer than --slow-ms with what the scheduler held (prefilling / decoding requests),
the TTFT of every 4th request, and the step-time summary; writes $OUT/serve_steps.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_ssm import LLM, SamplingParams  # noqa: E402
from pd_ssm.bench.shapes import write_shape  # noqa: E402
from pd_ssm.bench.workload import WorkloadSpec, make_workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--slow-ms", type=float, default=100.0)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests first (as bench serve's warm-up)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model = write_shape("mamba2-2.7b", "/tmp/mamba2-2.7b")
    t0 = time.perf_counter()
    llm = LLM(model, device="cuda", load_format="dummy", max_num_seqs=64, gpu_memory_utilization=0.35)
    print(f"engine built in {time.perf_counter() - t0:.1f} s", flush=True)
    eng = llm.engine
    # bench serve's own workload (same seed: the same prompts and arrivals as serve_gpu.sh sends)
    work = make_workload(WorkloadSpec(num_prompts=args.prompts, input_len=args.input_len,
                                      output_len=args.output_len, request_rate=args.rate))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    for _ in range(args.warmup):  # as bench serve's warm-up: the first prompt's first 16 tokens
        llm.generate([work[0].prompt[:16]], SamplingParams(max_tokens=2, ignore_eos=True))
    arrivals = [r.send_at for r in work]
    prompts = [r.prompt for r in work]
    prof = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    first: dict[str, float] = {}
    added: dict[str, float] = {}
    steps: list[dict[str, float]] = []
    nxt = 0
    if prof:
        prof.enable()
    while nxt < len(prompts) or eng.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(prompts) and arrivals[nxt] <= now:
            rid = eng.add_request(prompts[nxt], params, request_id=f"r{nxt}").req_id
            added[rid] = time.perf_counter() - start
            nxt += 1
        if not eng.has_unfinished():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        held = len(eng.requests)
        prefilling = len(eng.scheduler.prefill.prefilling) if eng.scheduler.prefill else 0
        s0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - s0
        now = time.perf_counter() - start
        for o in outs:
            if o.request_id not in first and o.outputs[0].token_ids:
                first[o.request_id] = now
        steps.append({"t": now, "ms": dt * 1e3, "held": held, "prefilling": prefilling})
        if dt * 1e3 > args.slow_ms:
            print(f"slow step at {now:6.2f} s: {dt * 1e3:8.1f} ms, {held} requests held, {prefilling} prefilling",
                  flush=True)
    if prof:
        prof.disable()
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    ttft = {rid: first[rid] - added[rid] for rid in added if rid in first}
    for i in range(0, args.prompts, 4):
        rid = f"r{i}"
        print(f"{rid}: arrived {added[rid]:6.2f} s, TTFT {ttft.get(rid, float('nan')) * 1e3:8.1f} ms")
    ms = sorted(s["ms"] for s in steps)
    print(f"{len(steps)} steps in {total:.2f} s; step ms p50 {ms[len(ms) // 2]:.2f}, p99 {ms[int(len(ms) * 0.99)]:.2f}, "
          f"max {ms[-1]:.1f}; TTFT p50 {sorted(ttft.values())[len(ttft) // 2] * 1e3:.1f} ms")
    (out_dir / "serve_steps.json").write_text(json.dumps({"steps": steps, "ttft": ttft, "args": vars(args)}))
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
        Path(args.profile).write_text(buf.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
