"""`pd-ssm serve` flags: engine flags reach the workers unchanged; bad flags fail before any process starts."""

from __future__ import annotations

import argparse
import random

import pytest

from pd_ssm.cli import _engine_flags, main
from pd_ssm.orchestrator.local import LocalDeployment, listen_socket
from pd_ssm.orchestrator.serve_cli import engine_argv


def _engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    _engine_flags(p)
    return p


def test_engine_flags_round_trip_through_worker_argv() -> None:
    rng = random.Random()
    parser = _engine_parser()
    for _ in range(50):
        argv = ["--model", "/some/dir", "--max-num-seqs", str(rng.randint(1, 512)),
                "--block-size", str(rng.choice([8, 16, 32])), "--dtype", rng.choice(["auto", "float32", "bfloat16"]),
                "--gpu-memory-utilization", str(round(rng.uniform(0.1, 0.95), 3))]
        if rng.random() < 0.5:
            argv += ["--max-model-len", str(rng.randint(64, 8192))]
        if rng.random() < 0.5:
            argv += ["--enforce-eager"]
        argv += rng.choice([[], ["--async-scheduling"], ["--no-async-scheduling"]])
        args = parser.parse_args(argv)
        rendered = engine_argv(args)
        assert "--model" not in rendered  # the launcher passes the resolved directory itself
        again = parser.parse_args(["--model", "/some/dir", *rendered])
        assert vars(again) == vars(args)


def test_bad_serve_flags_fail_early(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--routing-policy", "fastest", "--port", "0"]) == 2
    assert "unknown routing policy" in capsys.readouterr().err
    with pytest.raises(ValueError, match="num-workers"):
        LocalDeployment(model_dir="m", served_model_name="m", num_workers=0)
    with pytest.raises(ValueError, match="port"):
        LocalDeployment(model_dir="m", served_model_name="m", port=70000)
    with pytest.raises(ValueError, match="num-decode"):
        LocalDeployment(model_dir="m", served_model_name="m", disagg=True, num_decode=0)
    with pytest.raises(ValueError, match="connector"):
        LocalDeployment(model_dir="m", served_model_name="m", disagg=True, connector="tcp")
    with pytest.raises(ValueError, match="gpus"):
        LocalDeployment(model_dir="m", served_model_name="m", disagg=True, num_prefill=2, gpus=[0, 1])
    assert main(["serve", "--disagg", "--decode-routing-policy", "slowest", "--port", "0"]) == 2
    assert "unknown routing policy" in capsys.readouterr().err


def test_disagg_deployment_names_its_workers_by_role() -> None:
    dep = LocalDeployment(model_dir="m", served_model_name="m", disagg=True, num_prefill=2, num_decode=3)
    assert dep.worker_ids() == ["p0", "p1", "d0", "d1", "d2"] and dep.num_processes == 5
    assert LocalDeployment(model_dir="m", served_model_name="m", num_workers=2).worker_ids() == ["w0", "w1"]


def test_port_zero_gets_a_free_port() -> None:
    a, b = listen_socket("127.0.0.1", 0), listen_socket("127.0.0.1", 0)
    try:
        pa, pb = a.getsockname()[1], b.getsockname()[1]
        assert pa > 0 and pb > 0 and pa != pb
    finally:
        a.close()
        b.close()
