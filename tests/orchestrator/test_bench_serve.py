"""`pd-ssm bench serve` against real deployments on loopback: colocated (behind an API key) and
1 prefill + 1 decode worker; every request's token count is the one the workload asked for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pd_ssm.bench.serving import ServeBenchOptions, run_serve_bench
from pd_ssm.bench.workload import WorkloadSpec, make_workload
from tests.orchestrator.conftest import Serve, start_disagg

SPEC = WorkloadSpec(num_prompts=10, input_len=24, output_len=6, range_ratio=0.3, request_rate=40.0, seed=11)


def check_run(serve: Serve, spec: WorkloadSpec, max_concurrency: int | None) -> None:
    metrics, data = run_serve_bench(ServeBenchOptions(serve.url, spec, api_key=serve.api_key,
                                                      max_concurrency=max_concurrency))
    assert (metrics.completed, metrics.failed) == (spec.num_prompts, 0), data["errors"]
    for req, got in zip(make_workload(spec), data["requests"], strict=True):
        assert got["index"] == req.index and got["ok"]
        assert got["prompt_tokens"] == len(req.prompt)
        assert got["output_tokens"] == req.max_tokens  # ignore_eos: exactly what was asked
        assert 0 < got["ttft"] <= got["token_times"][-1] <= got["latency"]
        assert got["token_times"] == sorted(got["token_times"])
    assert metrics.output_tokens == sum(r.max_tokens for r in make_workload(spec))
    assert metrics.duration_s >= make_workload(spec)[-1].send_at  # the Poisson schedule was kept
    assert metrics.ttft_ms.p50 <= metrics.e2e_ms.p50 and metrics.tpot_ms.mean > 0


def test_bench_serve_colocated(api_server: Serve) -> None:
    check_run(api_server, SPEC, max_concurrency=3)


def test_bench_serve_disaggregated(tmp_path: Path, default_model: Path) -> None:
    serve = start_disagg(default_model, tmp_path / "serve.log")
    try:
        check_run(serve, SPEC, max_concurrency=None)
    finally:
        serve.stop()


def test_bench_serve_cli_reports_failures(api_server: Serve, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    base = [sys.executable, "-m", "pd_ssm.cli", "bench", "serve", "--base-url", api_server.url, "--num-prompts", "3",
            "--input-len", "8", "--output-len", "3"]
    ok = subprocess.run([*base, "--api-key", str(api_server.api_key), "--json", str(out)], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "3 completed, 0 failed" in ok.stdout and "TTFT" in ok.stdout
    assert json.loads(out.read_text())["metrics"]["output_tokens"] == 9
    # the model named explicitly (no /v1/models call), a wrong key: every request fails, named, exit 1
    bad = subprocess.run([*base, "--model", api_server.model_name(), "--api-key", "wrong"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1 and "0 completed, 3 failed" in bad.stdout and "HTTP 401" in bad.stdout
    url = subprocess.run([*base[:5], "--base-url", "ftp://nowhere"], capture_output=True, text=True, timeout=60)
    assert url.returncode == 2 and "http://host:port" in url.stderr
