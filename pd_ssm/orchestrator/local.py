"""Local launcher: the router plus its engine worker processes, on one machine.

Colocated (`pd-ssm serve`): N workers `w0..` each running prefill and decode.  Disaggregated
(`--disagg`): prefill workers `p0..` (`python -m pd_ssm.prefill_worker`) and decode workers `d0..`
(`python -m pd_ssm.decode_worker`) that move state pages over the chosen connector; they share a
random cluster token (environment, never argv) and, on CUDA, each sees one GPU of `gpus`
(CUDA_VISIBLE_DEVICES), so that an NCCL pair runs between two devices.

`pd-ssm serve` runs this.  The router (FastAPI under uvicorn) lives in the launcher's process and
event loop; each worker is `python -m pd_ssm.worker` with the engine flags passed through, told
the router's control address and the launcher's pid.  Ports: the HTTP port is --port (0: the OS
picks a free one, printed as `listening on http://HOST:PORT`); control sockets always bind to
OS-chosen ports and are exchanged in messages, so nothing is hard-coded.

Who starts the workers is a WorkerLauncher (launcher.py) composed into `serve`: ProcessLauncher
below (children of this process) or ray.RayLauncher (`--ray`: Ray actors on a cluster's nodes).

Supervision: a worker process that exits is logged with its exit code and marked dead in the
router at once (its requests end with 503, /health shows it, the others keep serving).
SIGINT / SIGTERM stop the HTTP server, ask every worker to shut down, then SIGTERM and finally
SIGKILL whatever is still alive: no child outlives the launcher.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from types import FrameType

import uvicorn

from pd_ssm.orchestrator.launcher import WorkerLauncher, worker_args
from pd_ssm.router.workers import WorkerPool
from pd_ssm.worker.transfer_flags import CLUSTER_TOKEN_ENV

log = logging.getLogger("pd_ssm.serve")

_SUPERVISE_PERIOD = 0.2  # seconds between checks of the worker processes
_STOP_GRACE = 5.0  # seconds a worker gets to exit after SIGTERM before SIGKILL


@dataclass(slots=True)
class LocalDeployment:
    model_dir: str
    served_model_name: str
    engine_argv: list[str] = field(default_factory=list)  # engine flags for every worker, minus --model
    num_workers: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    policy: str = "least_loaded"
    health_interval: float = 0.5
    health_timeout: float = 3.0
    device: str = "cpu"
    log_level: str = "INFO"
    disagg: bool = False
    num_prefill: int = 1
    num_decode: int = 1
    connector: str = "zmq"
    decode_policy: str = "least_loaded"
    gpus: list[int] | None = None  # CUDA: GPU index per worker, prefill workers first; None: 0, 1, ...
    transfer_argv: list[str] = field(default_factory=list)  # connector flags for disaggregated workers

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"--num-workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535 (0: pick a free one), got {self.port}")
        if self.disagg and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError(f"--disagg needs --num-prefill >= 1 and --num-decode >= 1, got "
                             f"{self.num_prefill} and {self.num_decode}")
        if self.connector not in ("zmq", "nccl"):
            raise ValueError(f"--connector must be zmq or nccl, got {self.connector!r}")
        if self.gpus is not None and len(self.gpus) < self.num_processes:
            raise ValueError(f"--gpus lists {len(self.gpus)} GPU(s) for {self.num_processes} workers: one each")

    @property
    def num_processes(self) -> int:
        return self.num_prefill + self.num_decode if self.disagg else self.num_workers

    def worker_ids(self) -> list[str]:
        if not self.disagg:
            return [f"w{i}" for i in range(self.num_workers)]
        return [f"p{i}" for i in range(self.num_prefill)] + [f"d{i}" for i in range(self.num_decode)]


@dataclass(slots=True)
class WorkerProcess:
    worker_id: str
    proc: subprocess.Popen[bytes]
    reported: bool = False  # its exit was logged and given to the router


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket; port 0 lets the OS choose (no race with other processes)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def _worker_env(dep: LocalDeployment, index: int, token: str) -> dict[str, str]:
    env = dict(os.environ)
    if dep.device == "cpu" and "OMP_NUM_THREADS" not in env:
        # N workers each using every core would thrash; split the cores between them
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // dep.num_processes))
    if dep.disagg:
        env[CLUSTER_TOKEN_ENV] = token
    if dep.device == "cuda" and (dep.disagg or dep.gpus is not None):
        env["CUDA_VISIBLE_DEVICES"] = str(dep.gpus[index] if dep.gpus is not None else index)
    return env


def spawn_worker(dep: LocalDeployment, worker_id: str, router_address: str, index: int = 0,
                 token: str = "") -> WorkerProcess:
    """Start worker `worker_id` (its first letter names its role) as the `index`-th process."""
    cmd = [sys.executable, *worker_args(dep, worker_id, router_address, os.getpid())]
    proc = subprocess.Popen(cmd, env=_worker_env(dep, index, token), stdin=subprocess.DEVNULL)
    log.info("started worker %s (pid %d)", worker_id, proc.pid)
    return WorkerProcess(worker_id, proc)


def stop_workers(workers: list[WorkerProcess]) -> None:
    """SIGTERM every live worker, wait up to _STOP_GRACE s, SIGKILL the rest; reaps them all."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    for w in workers:
        try:
            w.proc.wait(timeout=_STOP_GRACE)
        except subprocess.TimeoutExpired:
            log.warning("worker %s (pid %d) ignored SIGTERM; killing it", w.worker_id, w.proc.pid)
            w.proc.kill()
            w.proc.wait()


class ProcessLauncher:
    """WorkerLauncher for one machine: every worker a child process of the launcher."""

    def __init__(self, dep: LocalDeployment) -> None:
        self.dep = dep
        self.workers: list[WorkerProcess] = []

    def control_host(self) -> str:
        return "127.0.0.1" if self.dep.host in ("", "0.0.0.0", "::") else self.dep.host

    def describe(self) -> str:
        return "on this machine"

    def start(self, pool: WorkerPool, token: str) -> None:
        for index, (worker_id, handle) in enumerate(pool.workers.items()):
            self.workers.append(spawn_worker(self.dep, worker_id, pool.address, index, token))
            handle.pid = self.workers[-1].proc.pid  # /health shows it before the worker's hello

    async def supervise(self, pool: WorkerPool) -> None:
        while True:
            for w in self.workers:
                code = w.proc.poll()
                if code is not None and not w.reported:
                    w.reported = True
                    how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    log.error("worker %s (pid %d) %s", w.worker_id, w.proc.pid, how)
                    pool.mark_dead(w.worker_id, f"process {how}")
            await asyncio.sleep(_SUPERVISE_PERIOD)

    def stop(self) -> None:
        stop_workers(self.workers)


def _ignore(signum: int, frame: FrameType | None) -> None:
    # uvicorn captures SIGINT / SIGTERM while it serves and re-raises them to the previous
    # handler after its graceful shutdown; this handler makes that re-raise harmless so the
    # launcher's own cleanup (stopping every worker) still runs
    log.info("signal %d: shutting down", signum)


async def serve(dep: LocalDeployment, launcher: WorkerLauncher | None = None) -> int:
    """Run the deployment until SIGINT / SIGTERM; returns the exit status. `launcher` places the
    workers (default: child processes on this machine)."""
    launcher = launcher if launcher is not None else ProcessLauncher(dep)
    pool = WorkerPool(launcher.control_host(), expected=dep.worker_ids(),
                      health_interval=dep.health_interval, health_timeout=dep.health_timeout)
    sock = listen_socket(dep.host, dep.port)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)
    pool.start()
    supervisor: asyncio.Task[None] | None = None
    try:
        launcher.start(pool, secrets.token_hex(16))
        supervisor = asyncio.create_task(launcher.supervise(pool))
        # NOTE: imported only now: the router's tokenizer pulls in torch (seconds), which thus
        # loads while the workers load their engines instead of before they start
        from pd_ssm.router.app import Router, RouterConfig, create_app
        from pd_ssm.router.prompts import PromptBuilder

        router = Router(RouterConfig(dep.served_model_name, dep.api_key, dep.policy, dep.disagg, dep.decode_policy),
                        pool, PromptBuilder.from_model_dir(dep.model_dir))
        host, port = sock.getsockname()[:2]
        what = (f"{dep.num_prefill} prefill + {dep.num_decode} decode worker(s) over {dep.connector}"
                if dep.disagg else f"{dep.num_workers} worker(s)")
        print(f"pd-ssm serve: {what} {launcher.describe()}, model {dep.served_model_name!r}, "
              f"listening on http://{host}:{port}", flush=True)
        config = uvicorn.Config(create_app(router), log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        await uvicorn.Server(config).serve(sockets=[sock])
    finally:
        if supervisor is not None:
            supervisor.cancel()
        await asyncio.to_thread(launcher.stop)
        await pool.close()
        sock.close()
        log.info("stopped")
    return 0
