"""`pd-ssm serve` as a real process tree on loopback, for the end-to-end tests.

Every deployment binds port 0 (the OS picks; the launcher prints the address) and is torn down
with SIGTERM, then SIGKILL, so a failing test never leaves processes behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pd_ssm.bench.deploy import stop_process

# small pools: the tests look at page counts, and CPU memory is shared by every worker
ENGINE_FLAGS = ["--max-num-seqs", "8", "--num-kv-blocks", "128", "--block-size", "16"]
START_TIMEOUT = 25.0  # seconds for the launcher and all its workers to come up


@dataclass
class Serve:
    proc: subprocess.Popen[str]
    url: str
    log: Path
    api_key: str | None = None

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        h = {"Content-Type": "application/json", **(headers or {})}
        req = urllib.request.Request(self.url + path, data=data, headers=h, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def model_name(self) -> str:
        return json.loads(self.get("/v1/models", self.auth)[1])["data"][0]["id"]

    def health(self) -> dict[str, Any]:
        return json.loads(self.get("/health")[1])

    def metric(self, name: str, worker: str) -> float | None:
        text = self.get("/metrics")[1]
        m = re.search(rf'^{name}{{worker="{worker}"}} (\S+)$', text, re.M)
        return None if m is None else float(m.group(1))

    def wait_healthy(self, n: int, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pd-ssm serve exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                workers = json.loads(self.get("/health", self.auth)[1])["workers"]
            except (OSError, ValueError):
                workers = []
            if sum(w["status"] == "healthy" for w in workers) == n:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{n} healthy workers not seen in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> int:
        return stop_process(self.proc, 15.0)


def wait_until(pred: Callable[[], bool], within: float, what: str) -> None:
    """Poll `pred` until it holds; AssertionError naming `what` after `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {within} s: {what}")


def workers_by_id(serve: Serve) -> dict[str, dict[str, Any]]:
    """/health's workers, by id."""
    return {w["id"]: w for w in serve.health()["workers"]}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="session")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random hybrid (the serving tests check mechanics, not text; the trained default model
    costs several times more per token), written into a private cache directory."""
    from pd_ssm.default_model import random_model_dir

    old = os.environ.get("PD_SSM_CACHE")
    os.environ["PD_SSM_CACHE"] = str(tmp_path_factory.mktemp("pd_ssm_cache"))
    try:
        return random_model_dir()
    finally:
        if old is None:
            del os.environ["PD_SSM_CACHE"]
        else:
            os.environ["PD_SSM_CACHE"] = old


def start_serve(model: Path, log: Path, *extra: str, workers: int = 1, timeout: float = START_TIMEOUT) -> Serve:
    cmd = [sys.executable, "-m", "pd_ssm.cli", "serve", "--model", str(model), "--port", "0",
           "--num-workers", str(workers), "--health-interval", "0.2", "--health-timeout", "1.5",
           *ENGINE_FLAGS, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    assert proc.stdout is not None
    # the launcher prints its address before any worker is up (under --ray, Ray may print first)
    m = None
    for _ in range(100):
        line = proc.stdout.readline()
        m = re.search(r"listening on (http://\S+)", line)
        if m is not None or not line:
            break
    if m is None:
        proc.kill()
        raise RuntimeError(f"no address from pd-ssm serve: {line!r}\n{log.read_text()[-3000:]}")
    serve = Serve(proc, m.group(1), log)
    try:
        serve.wait_healthy(workers, timeout)
    except Exception:
        serve.stop()
        raise
    return serve


@pytest.fixture
def serve_factory(tmp_path: Path, default_model: Path) -> Iterator[Callable[..., Serve]]:
    started: list[Serve] = []

    def make(*extra: str, workers: int = 1) -> Serve:
        s = start_serve(default_model, tmp_path / f"serve-{len(started)}.log", *extra, workers=workers)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def api_server(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Iterator[Serve]:
    """One colocated worker behind an API key, shared by the tests that do not break it."""
    key = "test-key-" + os.urandom(4).hex()
    s = start_serve(default_model, tmp_path_factory.mktemp("serve") / "serve.log", "--api-key", key)
    s.api_key = key
    yield s
    s.stop()


DISAGG_START_TIMEOUT = 50.0  # seconds: 2-4 engine processes load at once (CI machines have few cores)


def start_disagg(model: Path, log: Path, *extra: str, prefill: int = 1, decode: int = 1,
                 connector: str = "zmq") -> Serve:
    """`pd-ssm serve --disagg` with `prefill` + `decode` workers; returns once all are healthy."""
    return start_serve(model, log, "--disagg", "--num-prefill", str(prefill), "--num-decode", str(decode),
                       "--connector", connector, *extra, workers=prefill + decode, timeout=DISAGG_START_TIMEOUT)


def pool_metrics(serve: Serve, worker: str) -> dict[str, float | None]:
    """The page gauges of one worker, as /metrics shows them."""
    names = ["pd_ssm_state_slots_used", "pd_ssm_kv_blocks_used", "pd_ssm_state_slots_reserved",
             "pd_ssm_transfers_in_flight", "pd_ssm_pool_invariant_ok", "pd_ssm_num_requests_running",
             "pd_ssm_num_requests_waiting"]
    return {n: serve.metric(n, worker) for n in names}


def pools_empty(serve: Serve, worker: str) -> bool:
    """No page held, none reserved, nothing in transfer, invariant checked by the worker."""
    m = pool_metrics(serve, worker)
    return m["pd_ssm_pool_invariant_ok"] == 1.0 and all(
        m[n] == 0.0 for n in m if n != "pd_ssm_pool_invariant_ok")
