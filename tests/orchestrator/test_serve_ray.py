"""`pd-ssm serve --ray` against a real Ray cluster started by these tests (`ray start --head` on this
machine, its own process group, stopped at the end; Ray's default token authentication on).

Each worker runs as a process of a WorkerHost actor placed in a placement-group bundle; the router
stays in the launcher.  Checked: outputs equal `LLM.generate` (colocated and 1P+1D over ZMQ, with
the role resources of deploy/cluster.yaml); a killed worker is marked dead and started again under
a new id, and serves the same tokens; a placement the cluster cannot fit ends the launch with a
clear error; stopping leaves no worker process, no actor's resources and no placement group.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd_ssm import LLM, SamplingParams
from tests.orchestrator.conftest import (
    DISAGG_START_TIMEOUT,
    Serve,
    alive,
    pools_empty,
    start_serve,
    wait_until,
    workers_by_id,
)
from tests.orchestrator.test_serve_openai import random_text

pytest.importorskip("ray", reason="Ray is not installed here (pip install 'pd-ssm[ray]')")

CLUSTER_CPUS = 4
HEAD_START_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A one-node Ray cluster with the role resources of deploy/cluster.yaml's node types."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("ray") / "head.log"
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "token"  # what a client of a `ray start` head (token auth by default) needs
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port", str(port),
           "--num-cpus", str(CLUSTER_CPUS), "--resources", json.dumps({"pd_prefill": 1, "pd_decode": 1}),
           "--include-dashboard", "false", "--disable-usage-stats"]
    with open(log, "w") as out:
        head = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + HEAD_START_TIMEOUT
        while "Ray runtime started" not in log.read_text():
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start failed:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # --block: the head stops every Ray process it started
        try:
            head.wait(timeout=40)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # whatever of its session is left
        except ProcessLookupError:
            pass
        if old is None:
            del os.environ["RAY_AUTH_MODE"]
        else:
            os.environ["RAY_AUTH_MODE"] = old


def cluster_state(address: str) -> dict[str, Any]:
    """Placement groups (id -> state) and available resources, read by a driver of its own."""
    code = ("import json, ray\n"
            f"ray.init(address={address!r}, log_to_driver=False)\n"
            "from ray.util import placement_group_table\n"
            "pgs = {k: v['state'] for k, v in placement_group_table().items()}\n"
            "print(json.dumps({'pgs': pgs, 'available': ray.available_resources()}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference(default_model: Path) -> LLM:
    return LLM(model=str(default_model), max_num_seqs=8, num_kv_blocks=128, block_size=16)


def ray_serve(model: Path, log: Path, address: str, *extra: str, workers: int) -> Serve:
    return start_serve(model, log, "--ray", "--ray-address", address, *extra, workers=workers,
                       timeout=DISAGG_START_TIMEOUT)


def greedy_ids(serve: Serve, prompt: str, n: int) -> list[int]:
    status, body = serve.post("/v1/completions", {"model": serve.model_name(), "prompt": prompt, "max_tokens": n,
                                                  "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
    assert status == 200, body
    return list(body["choices"][0]["token_ids"])


def expect_same(serve: Serve, reference: LLM, rng: random.Random, count: int) -> None:
    for _ in range(count):
        prompt, n = random_text(rng), rng.randint(2, 12)
        ref = reference.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        assert greedy_ids(serve, prompt, n) == ref.outputs[0].token_ids, prompt


def parent_cmdline(pid: int) -> str:
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def gone(pid: int) -> bool:
    # a zombie no one reaped yet counts as gone (the workers are children of Ray actors, not of ours)
    try:
        return not alive(pid) or Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:  # reaped between the two looks
        return True


def test_colocated_workers_on_ray_match_generate_and_leave_nothing(
        ray_address: str, default_model: Path, reference: LLM, tmp_path: Path) -> None:
    rng = random.Random(1234)
    serve = ray_serve(default_model, tmp_path / "serve.log", ray_address, workers=2)
    try:
        pids = [w["pid"] for w in serve.health()["workers"]]
        assert len(pids) == 2
        for pid in pids:  # each a process of a WorkerHost actor, not of the launcher
            assert "WorkerHost" in parent_cmdline(pid)
        state = cluster_state(ray_address)
        assert list(state["pgs"].values()) == ["CREATED"]
        assert state["available"].get("CPU", 0.0) == CLUSTER_CPUS - 2
        expect_same(serve, reference, rng, 4)
    finally:
        assert serve.stop() == 0
    wait_until(lambda: all(gone(p) for p in pids), 15, f"worker processes {pids} outlived the launcher")
    state = cluster_state(ray_address)
    assert set(state["pgs"].values()) == {"REMOVED"}
    assert state["available"]["CPU"] == CLUSTER_CPUS


def test_disagg_on_ray_uses_role_resources_and_restarts_a_killed_worker(
        ray_address: str, default_model: Path, reference: LLM, tmp_path: Path) -> None:
    rng = random.Random(99)
    serve = ray_serve(default_model, tmp_path / "serve.log", ray_address, "--disagg", "--num-prefill", "1",
                      "--num-decode", "1", "--connector", "zmq", "--ray-role-resources", "--ray-max-restarts", "1",
                      workers=2)
    try:
        available = cluster_state(ray_address)["available"]
        assert available.get("pd_prefill", 0.0) == 0.0 and available.get("pd_decode", 0.0) == 0.0
        expect_same(serve, reference, rng, 2)
        decode_pid = workers_by_id(serve)["d0"]["pid"]
        os.kill(decode_pid, signal.SIGKILL)

        def restarted() -> bool:
            by_id = workers_by_id(serve)
            return by_id["d0"]["status"] == "dead" and by_id.get("d0.1", {}).get("status") == "healthy"

        wait_until(restarted, DISAGG_START_TIMEOUT, f"d0 not restarted as d0.1:\n{serve.log.read_text()[-3000:]}")
        assert "signal 9" in workers_by_id(serve)["d0"]["error"]
        expect_same(serve, reference, rng, 2)
        assert pools_empty(serve, "p0") and pools_empty(serve, "d0.1")
    finally:
        assert serve.stop() == 0
    assert set(cluster_state(ray_address)["pgs"].values()) == {"REMOVED"}


def test_a_placement_the_cluster_cannot_fit_fails_clearly(ray_address: str, default_model: Path,
                                                          tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pd_ssm.cli", "serve", "--model", str(default_model), "--port", "0", "--ray",
           "--ray-address", ray_address, "--num-workers", "2", "--ray-cpus-per-worker", "64",
           "--ray-placement-timeout", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "could not place 2 worker(s)" in out.stderr and "CPU: 128" in out.stderr, out.stderr[-3000:]
    assert set(cluster_state(ray_address)["pgs"].values()) <= {"REMOVED"}
