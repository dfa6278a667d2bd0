"""benchmarks/nccl_gpu_check.py, the script the lead runs on two GPUs: here on CPU (gloo) with
small pages, and its verdict logic on reports that must fail."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "nccl_gpu_check.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nccl_gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


def test_runs_on_cpu_and_writes_a_passing_summary(tmp_path: Path) -> None:
    args = ["--device", "cpu", "--layers", "3", "--conv-shape", "47,3", "--ssm-shape", "4,8,16",
            "--in-flight", "64", "--timeout", "15"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env={**os.environ, "OUT": str(tmp_path)},
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "nccl_gpu_check.json").read_text())
    assert summary["ok"] and summary["problems"] == []
    assert summary["receiver"]["received"] == 65 and summary["receiver"]["reservations_left"] == 0
    phases = summary["sender"]["phases"]
    assert phases["in_flight"]["posted_at_once"] == 64 and phases["in_flight"]["sent"] == 64


def test_verdict_fails_on_a_flipped_bit_a_missing_request_or_a_dead_process() -> None:
    m = load_script()
    s = m.Setup(2, (5, 3), (4, 8), 2, 5.0, "cpu", "cpu")
    a = m.make_pages("f1", m.seed_of("f1"), s, "cpu")
    b = m.make_pages("f1", m.seed_of("f1"), s, "cpu")
    assert m.mismatches(a, b) == [] and torch.all(a.layers[1].tensors["ssm"] != 0)
    b.layers[1].tensors["ssm"].view(torch.int32)[2, 3] ^= 1
    assert m.mismatches(a, b) == ["layer 1 ssm"]
    good_rx = {"received": 3, "missing": [], "mismatched": {}, "failed": {}, "reservations_left": 0}
    phase = {"requests": 2, "failed": {}, "sent": 2, "left_in_flight": 0, "flushed": True, "posted_at_once": 2}
    good_tx = {"phases": {"exact": {**phase, "requests": 1, "sent": 1}, "in_flight": phase}}
    assert m.check(s, {"receiver": good_rx, "sender": good_tx}, [0, 0]) == []
    assert m.check(s, {"receiver": {**good_rx, "mismatched": {"f1": ["layer 1 ssm"]}}, "sender": good_tx}, [0, 0])
    assert m.check(s, {"receiver": {**good_rx, "missing": ["f0"]}, "sender": good_tx}, [0, 0])
    assert m.check(s, {"receiver": good_rx, "sender": good_tx}, [0, -9])
    assert m.check(s, {"receiver": good_rx}, [0, 0])
