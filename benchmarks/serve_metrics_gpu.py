"""A launched deployment under two workloads, with the router's own figures between them: one request
at a time (what a request costs alone), then a loaded run; after each, the transfer histograms and
per-worker counters of /metrics. Where the disaggregated path's time goes, without a profiler.

    python benchmarks/serve_metrics_gpu.py [--kind disagg] [--serve-args "..."] [--rate 8]

Defaults: Mamba2-2.7B shape with dummy weights (config written to /tmp/mamba2-2.7b), 1P+1D on GPU 0
over ZMQ (benchmarks/serve_gpu.sh's flags). Prints both tables and the /metrics lines that name
transfers, TTFT or TPOT; writes $OUT/serve_metrics.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_ssm.bench.deploy import launch  # noqa: E402
from pd_ssm.bench.metrics import format_table  # noqa: E402
from pd_ssm.bench.serving import ServeBenchOptions, run_serve_bench  # noqa: E402
from pd_ssm.bench.shapes import write_shape  # noqa: E402
from pd_ssm.bench.workload import WorkloadSpec  # noqa: E402

MODEL = Path("/tmp/mamba2-2.7b")
DEFAULT_ARGS = (f"--model {MODEL} --load-format dummy --device cuda --gpus 0,0 --num-prefill 1 --num-decode 1 "
                "--connector zmq --gpu-memory-utilization 0.35 --max-num-seqs 64")
KEEP = ("pd_ssm_transfer", "pd_ssm_worker_transfer", "pd_ssm_time_to_first_token", "pd_ssm_time_per_output")


def scrape(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    # histograms as their sum and count (the buckets are many), counters as they are
    return [line for line in text.splitlines() if line.startswith(KEEP) and "_bucket" not in line
            and "_created" not in line and not line.endswith(" 0.0")]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="disagg", choices=["colocated", "disagg"])
    ap.add_argument("--serve-args", default=DEFAULT_ARGS)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--rate", type=float, default=8.0)
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    write_shape("mamba2-2.7b", MODEL)
    server = launch(args.kind, shlex.split(args.serve_args), 420.0)
    phases = {"alone": WorkloadSpec(num_prompts=12, input_len=args.input_len, output_len=16),
              "loaded": WorkloadSpec(num_prompts=64, input_len=args.input_len, output_len=128,
                                     request_rate=args.rate, seed=1)}
    report: dict[str, object] = {}
    try:
        for name, spec in phases.items():
            opts = ServeBenchOptions(server.url, spec, max_concurrency=1 if name == "alone" else None)
            metrics, _ = run_serve_bench(opts)
            print(format_table(metrics, f"{args.kind}, {name}: {spec.num_prompts} x {spec.input_len} -> "
                                        f"{spec.output_len}"), flush=True)
            lines = scrape(server.url)
            print("\n".join(lines), flush=True)
            report[name] = {"metrics": dataclasses.asdict(metrics), "router": lines}
    finally:
        server.stop()
        print(f"server log: {server.log}", flush=True)
    (out / "serve_metrics.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
