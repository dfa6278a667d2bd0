"""WorkerLauncher: what starts, watches and stops a deployment's worker processes, so that the
router side of `pd-ssm serve` (local.serve) is the same whoever places the workers.

Two launchers compose into it: local.ProcessLauncher (child processes of the launcher, on this
machine) and ray.RayLauncher (one Ray actor per worker, placed by a placement group, each running
the same worker process on its node).  Both run `worker_args`: a worker is the same program
wherever it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pd_ssm.orchestrator.local import LocalDeployment
    from pd_ssm.router.workers import WorkerPool

# the module each role runs, by the first letter of its worker id
WORKER_MODULES = {"w": "pd_ssm.worker", "p": "pd_ssm.prefill_worker", "d": "pd_ssm.decode_worker"}


def worker_args(dep: LocalDeployment, worker_id: str, router_address: str, parent_pid: int,
                host: str = "127.0.0.1") -> list[str]:
    """The arguments after the Python interpreter (each node runs its own) that start worker
    `worker_id` (its first letter names its role; a restart keeps it: `p0.1`).

    `host`: the interface its command and data sockets bind on, which the router and the other
    workers must reach; `parent_pid`: the process whose exit makes it exit (whoever started it).
    """
    extra = dep.transfer_argv if dep.disagg else []
    return ["-m", WORKER_MODULES[worker_id[0]], "--worker-id", worker_id, "--router", router_address,
            "--host", host, "--model", dep.model_dir, "--served-model-name", dep.served_model_name,
            "--parent-pid", str(parent_pid), "--log-level", dep.log_level, *dep.engine_argv, *extra]


class WorkerLauncher(Protocol):
    """Starts the workers `pool` expects, reports their exits to it, and stops them all."""

    def control_host(self) -> str:
        """The address the router's control socket binds on: one every worker can reach."""
        ...

    def describe(self) -> str:
        """Where the workers run, for the startup line (e.g. "on this machine")."""
        ...

    def start(self, pool: WorkerPool, token: str) -> None:
        """Start one worker per id in `pool.workers` (`token`: the disaggregated workers' secret)."""
        ...

    async def supervise(self, pool: WorkerPool) -> None:
        """Run until cancelled: a worker that exits is marked dead in `pool` (and maybe restarted)."""
        ...

    def stop(self) -> None:
        """Stop every worker (blocking; no process outlives it) and release what was acquired."""
        ...


class LaunchError(RuntimeError):
    """The workers cannot be started as asked (e.g. Ray missing, or a cluster without room for them)."""
