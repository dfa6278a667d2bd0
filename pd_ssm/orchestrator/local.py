"""Local launcher: N colocated engine worker processes plus the router, on one machine.

`pd-ssm serve` runs this.  The router (FastAPI under uvicorn) lives in the launcher's process and
event loop; each worker is `python -m pd_ssm.worker` with the engine flags passed through, told
the router's control address and the launcher's pid.  Ports: the HTTP port is --port (0: the OS
picks a free one, printed as `listening on http://HOST:PORT`); control sockets always bind to
OS-chosen ports and are exchanged in messages, so nothing is hard-coded.

Supervision: a worker process that exits is logged with its exit code and marked dead in the
router at once (its requests end with 503, /health shows it, the others keep serving).
SIGINT / SIGTERM stop the HTTP server, ask every worker to shut down, then SIGTERM and finally
SIGKILL whatever is still alive: no child outlives the launcher.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from types import FrameType

import uvicorn

from pd_ssm.router.workers import WorkerPool

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

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"--num-workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535 (0: pick a free one), got {self.port}")


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


def _worker_env(dep: LocalDeployment) -> dict[str, str]:
    env = dict(os.environ)
    if dep.device == "cpu" and "OMP_NUM_THREADS" not in env:
        # N workers each using every core would thrash; split the cores between them
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // dep.num_workers))
    return env


def spawn_worker(dep: LocalDeployment, worker_id: str, router_address: str) -> WorkerProcess:
    cmd = [sys.executable, "-m", "pd_ssm.worker", "--worker-id", worker_id, "--router", router_address,
           "--model", dep.model_dir, "--served-model-name", dep.served_model_name,
           "--parent-pid", str(os.getpid()), "--log-level", dep.log_level, *dep.engine_argv]
    proc = subprocess.Popen(cmd, env=_worker_env(dep), stdin=subprocess.DEVNULL)
    log.info("started worker %s (pid %d)", worker_id, proc.pid)
    return WorkerProcess(worker_id, proc)


async def supervise(workers: list[WorkerProcess], pool: WorkerPool) -> None:
    while True:
        for w in workers:
            code = w.proc.poll()
            if code is not None and not w.reported:
                w.reported = True
                how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                log.error("worker %s (pid %d) %s", w.worker_id, w.proc.pid, how)
                pool.mark_dead(w.worker_id, f"process {how}")
        await asyncio.sleep(_SUPERVISE_PERIOD)


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


def _ignore(signum: int, frame: FrameType | None) -> None:
    # uvicorn captures SIGINT / SIGTERM while it serves and re-raises them to the previous
    # handler after its graceful shutdown; this handler makes that re-raise harmless so the
    # launcher's own cleanup (stopping every worker) still runs
    log.info("signal %d: shutting down", signum)


async def serve(dep: LocalDeployment) -> int:
    """Run the deployment until SIGINT / SIGTERM; returns the exit status."""
    pool = WorkerPool("127.0.0.1" if dep.host in ("", "0.0.0.0", "::") else dep.host,
                      expected=[f"w{i}" for i in range(dep.num_workers)],
                      health_interval=dep.health_interval, health_timeout=dep.health_timeout)
    sock = listen_socket(dep.host, dep.port)
    workers: list[WorkerProcess] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)
    pool.start()
    supervisor = asyncio.create_task(supervise(workers, pool))
    try:
        for worker_id, handle in pool.workers.items():
            workers.append(spawn_worker(dep, worker_id, pool.address))
            handle.pid = workers[-1].proc.pid  # /health shows it before the worker's hello
        # NOTE: imported only now: the router's tokenizer pulls in torch (seconds), which thus
        # loads while the workers load their engines instead of before they start
        from pd_ssm.router.app import Router, RouterConfig, create_app
        from pd_ssm.router.prompts import PromptBuilder

        router = Router(RouterConfig(dep.served_model_name, dep.api_key, dep.policy), pool,
                        PromptBuilder.from_model_dir(dep.model_dir))
        host, port = sock.getsockname()[:2]
        print(f"pd-ssm serve: {dep.num_workers} worker(s), model {dep.served_model_name!r}, "
              f"listening on http://{host}:{port}", flush=True)
        config = uvicorn.Config(create_app(router), log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        await uvicorn.Server(config).serve(sockets=[sock])
    finally:
        supervisor.cancel()
        await asyncio.to_thread(stop_workers, workers)
        await pool.close()
        sock.close()
        log.info("stopped")
    return 0
