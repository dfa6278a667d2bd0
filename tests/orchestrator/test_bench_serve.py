"""`pd-ssm bench serve` against real deployments on loopback: a colocated one behind an API key, and
the colocated + 1 prefill / 1 decode pair it launches itself (`--launch both`); every request's
token count is the one the workload asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pd_ssm.bench.deploy import serve_argv
from pd_ssm.bench.serving import ServeBenchOptions, run_serve_bench
from pd_ssm.bench.workload import WorkloadSpec, make_workload
from tests.orchestrator.conftest import ENGINE_FLAGS, Serve

SPEC = WorkloadSpec(num_prompts=10, input_len=24, output_len=6, range_ratio=0.3, request_rate=40.0, seed=11)


def check_requests(spec: WorkloadSpec, data: dict[str, Any]) -> None:
    """Every request of the run completed with exactly the tokens the workload asked for."""
    assert data["errors"] == [] and data["metrics"]["failed"] == 0
    for req, got in zip(make_workload(spec), data["requests"], strict=True):
        assert got["index"] == req.index and got["ok"]
        assert got["prompt_tokens"] == len(req.prompt)
        assert got["output_tokens"] == req.max_tokens  # ignore_eos: exactly what was asked
        assert 0 < got["ttft"] <= got["token_times"][-1] <= got["latency"]
        assert got["token_times"] == sorted(got["token_times"])


def test_bench_serve_colocated(api_server: Serve) -> None:
    metrics, data = run_serve_bench(ServeBenchOptions(api_server.url, SPEC, api_key=api_server.api_key,
                                                      max_concurrency=3))
    check_requests(SPEC, data)
    assert metrics.completed == SPEC.num_prompts
    assert metrics.output_tokens == sum(r.max_tokens for r in make_workload(SPEC))
    assert metrics.duration_s >= make_workload(SPEC)[-1].send_at  # the Poisson schedule was kept
    assert metrics.ttft_ms.p50 <= metrics.e2e_ms.p50 and metrics.tpot_ms.mean > 0


def test_bench_serve_launches_both_deployments(tmp_path: Path, default_model: Path) -> None:
    """`--launch both`: a colocated and a 1P+1D deployment started, benchmarked with one workload, compared
    and stopped."""
    out = tmp_path / "both.json"
    spec = WorkloadSpec(num_prompts=6, input_len=12, output_len=4, seed=5)
    serve_args = f"--model {default_model} --num-prefill 1 --num-decode 1 " + " ".join(ENGINE_FLAGS)
    run = subprocess.run(
        [sys.executable, "-m", "pd_ssm.cli", "bench", "serve", "--launch", "both", "--serve-args", serve_args,
         "--num-prompts", "6", "--input-len", "12", "--output-len", "4", "--seed", "5", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[colocated]" in run.stdout and "[disagg]" in run.stdout and "TTFT p99 (ms)" in run.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["deployment"] for r in runs] == ["colocated", "disagg"]
    for r in runs:
        check_requests(spec, r)
        with pytest.raises(OSError):  # stopped: nothing answers there any more
            urllib.request.urlopen(r["base_url"] + "/health", timeout=5)


def test_launch_refuses_flags_it_owns() -> None:
    assert serve_argv("disagg", ["--num-decode", "2"])[-3:] == ["--disagg", "--num-decode", "2"]
    for bad in (["--port", "9"], ["--port=9"], ["--disagg"]):
        with pytest.raises(ValueError, match="must not set"):
            serve_argv("colocated", bad)
    with pytest.raises(ValueError, match="one of"):
        serve_argv("both", [])


def test_bench_serve_cli_reports_failures(api_server: Serve, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    base = [sys.executable, "-m", "pd_ssm.cli", "bench", "serve", "--base-url", api_server.url, "--num-prompts", "3",
            "--input-len", "8", "--output-len", "3"]
    ok = subprocess.run([*base, "--api-key", str(api_server.api_key), "--json", str(out)], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "3 completed, 0 failed" in ok.stdout and "TTFT" in ok.stdout
    assert json.loads(out.read_text())["metrics"]["output_tokens"] == 9
    # the model named explicitly (no /v1/models call), a wrong key: without a warm-up every request
    # fails, named, exit 1; with one, the warm-up's failure stops the run, exit 2
    bad = [*base, "--model", api_server.model_name(), "--api-key", "wrong"]
    failed = subprocess.run([*bad, "--warmup-requests", "0"], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "0 completed, 3 failed" in failed.stdout and "HTTP 401" in failed.stdout
    stopped = subprocess.run(bad, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 2 and "warm-up request" in stopped.stderr and "HTTP 401" in stopped.stderr
    url = subprocess.run([*base[:5], "--base-url", "ftp://nowhere"], capture_output=True, text=True, timeout=60)
    assert url.returncode == 2 and "http://host:port" in url.stderr
