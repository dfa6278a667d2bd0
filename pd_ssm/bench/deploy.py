"""A `pd-ssm serve` deployment started by a benchmark on this machine (`pd-ssm bench serve --launch`):
a child process on a free loopback port, ready once every worker it lists is healthy, and stopped
(SIGTERM, then SIGKILL) whatever happens to the benchmark."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEPLOYMENTS = ("colocated", "disagg")


@dataclass(slots=True)
class LaunchedServer:
    kind: str
    proc: subprocess.Popen[str]
    url: str
    log: Path

    def stop(self) -> int:
        return stop_process(self.proc, 20.0)


def stop_process(proc: subprocess.Popen[str], grace: float) -> int:
    """SIGTERM a `pd-ssm serve` (it stops its workers), SIGKILL it after `grace` seconds; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def serve_argv(kind: str, serve_args: list[str]) -> list[str]:
    """The `pd-ssm serve` command of a deployment: `serve_args` (engine flags, --num-prefill, ...) for
    both kinds, `--disagg` added for the disaggregated one, the port left to the OS."""
    if kind not in DEPLOYMENTS:
        raise ValueError(f"a deployment is one of {', '.join(DEPLOYMENTS)}, not {kind!r}")
    if any(a == "--port" or a.startswith("--port=") or a == "--disagg" for a in serve_args):
        raise ValueError("--serve-args must not set --port or --disagg: the benchmark chooses them")
    return [sys.executable, "-m", "pd_ssm.cli", "serve", "--port", "0", *(["--disagg"] if kind == "disagg" else []),
            *serve_args]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            workers = json.loads(r.read())["workers"]
    except (OSError, ValueError, KeyError):
        return False
    return bool(workers) and all(w["status"] == "healthy" for w in workers)


def launch(kind: str, serve_args: list[str], timeout: float = 120.0) -> LaunchedServer:
    """Start a deployment and return once it serves; RuntimeError (with its log's tail) if it does not
    within `timeout` seconds."""
    log = Path(tempfile.mkstemp(prefix=f"pd_ssm_bench_{kind}_", suffix=".log")[1])
    with open(log, "w") as err:
        proc = subprocess.Popen(serve_argv(kind, serve_args), stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the launcher prints its address before any worker is up
    m = re.search(r"listening on (http://\S+)", line)
    server = LaunchedServer(kind, proc, m.group(1) if m else "", log)
    try:
        if m is None:
            raise RuntimeError(f"pd-ssm serve printed no address: {line!r}")
        deadline = time.monotonic() + timeout
        while not _healthy(server.url):
            if proc.poll() is not None:
                raise RuntimeError(f"pd-ssm serve exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {kind} deployment was not healthy within {timeout:.0f} s")
            time.sleep(0.2)
    except RuntimeError as e:
        server.stop()
        raise RuntimeError(f"{e}; its log ({log}) ends:\n{log.read_text()[-2000:]}") from None
    except BaseException:  # Ctrl-C while waiting: leave no server behind
        server.stop()
        raise
    return server
