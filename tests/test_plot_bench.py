"""scripts/plot_bench.py: `pd-ssm bench engine|kernels|serve --json` results drawn as PNGs (CPU, matplotlib)."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pd_ssm.bench.client import RequestResult
from pd_ssm.bench.metrics import summarize
from pd_ssm.bench.workload import WorkloadSpec

pytest.importorskip("matplotlib", reason="the plots need matplotlib (a test extra)")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "plot_bench.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plot_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["plot_bench"] = module
    spec.loader.exec_module(module)
    return module


plot_bench = load_script()


def engine_result(rng: random.Random) -> dict[str, Any]:
    """`bench engine`'s JSON shape (pd_ssm/bench/engine.py BenchRow), random figures."""
    rows = []
    for name, kind, met in (("prefill 2048 tok, batch 1", "matmul", None), ("decode batch 1", "memory", True),
                            ("decode batch 32", "memory", False)):
        floor = rng.uniform(1.0, 20.0)
        rows.append(dict(name=name, measured_ms=floor * rng.uniform(1.05, 1.6), floor_ms=floor, floor_kind=kind,
                         target="<= 1.25 x floor", met=met, bytes_moved=rng.randint(1, 10**10), note=""))
    return dict(device="NVIDIA H200", model="dummy", dtype="bfloat16", rows=rows)


def kernels_result(rng: random.Random) -> dict[str, Any]:
    """`bench kernels`' JSON shape (pd_ssm/bench/kernels.py), random figures; one row without a baseline."""
    rows = []
    for kernel, shape, base in (("ssd", "1x8192", True), ("selective_state_update [graph]", "batch 64", True),
                                ("rms_norm_gated", "2048 tokens", False)):
        ms = rng.uniform(0.01, 1.0)
        base_ms = ms * rng.uniform(0.8, 3.0) if base else None
        rows.append(dict(kernel=kernel, shape=shape, ms=ms, gbps=rng.uniform(100, 4000),
                         pct_copy=rng.uniform(1, 99), tflops=rng.uniform(0, 500), pct_mma=rng.uniform(0, 60),
                         baseline_ms=base_ms, speedup=base_ms / ms if base_ms else None,
                         note="" if base else "baseline not available"))
    return dict(copy_gbps=4200.0, bf16_mma_tflops=780.0, device="NVIDIA H200", rows=rows)


def serve_result(rng: random.Random) -> dict[str, Any]:
    """`bench serve`'s JSON shape (pd_ssm/bench/serving.py), from random request timings."""
    results = []
    for i in range(20):
        r = RequestResult(i, prompt_tokens=rng.randint(8, 64), ok=i != 3)
        r.ttft = rng.uniform(0.02, 0.3)
        r.token_times = sorted(r.ttft + rng.uniform(0.0, 0.5) for _ in range(rng.randint(2, 12)))
        r.token_times[0] = r.ttft
        r.output_tokens, r.latency = len(r.token_times), r.token_times[-1]
        results.append(r)
    return {"model": "m", "workload": asdict(WorkloadSpec(num_prompts=20)),
            "metrics": summarize(results, 1.5).as_dict(), "requests": [asdict(r) for r in results]}


@pytest.mark.parametrize("kind", ["engine", "kernels", "serve"])
def test_draws_a_png_of_each_kind(tmp_path: Path, kind: str) -> None:
    rng = random.Random(7)
    result = {"engine": engine_result, "kernels": kernels_result, "serve": serve_result}[kind](rng)
    src = tmp_path / f"{kind}.json"
    src.write_text(json.dumps(result))
    out = tmp_path / "plots" / f"{kind}.png"
    assert plot_bench.read_result(src)[0] == kind
    assert plot_bench.main([str(src), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_draws_both_deployments_of_a_launch_both_run(tmp_path: Path) -> None:
    rng = random.Random(11)
    runs = [{**serve_result(rng), "deployment": kind} for kind in ("colocated", "disagg")]
    src = tmp_path / "both.json"
    src.write_text(json.dumps({"runs": runs}))
    kind, result = plot_bench.read_result(src)
    assert kind == "serve" and [r["deployment"] for r in result["runs"]] == ["colocated", "disagg"]
    out = tmp_path / "both.png"
    assert plot_bench.main([str(src), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    src.write_text(json.dumps({"runs": [runs[0], {"rows": []}]}))  # a run that is not bench serve's
    with pytest.raises(ValueError, match="not a `pd-ssm bench"):
        plot_bench.read_result(src)


def test_refuses_what_no_bench_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"name": "x"}]}))
    with pytest.raises(ValueError, match="neither"):
        plot_bench.read_result(bad)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps([1, 2]))
    assert plot_bench.main([str(empty), "--out", str(tmp_path / "x.png")]) == 2
    assert "not a `pd-ssm bench" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
