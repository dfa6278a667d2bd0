"""RayLauncher: `pd-ssm serve --ray`, the deployment's workers placed and supervised by Ray.

The router stays in the launcher's process (on the head node, or wherever `pd-ssm serve --ray`
runs); only the workers are placed:

- one placement group for the deployment, one bundle per worker: `--ray-cpus-per-worker` CPUs,
  one GPU with `--device cuda`, and with `--ray-role-resources` one unit of `pd_prefill` /
  `pd_decode`, the custom resources deploy/cluster.yaml gives its prefill and decode node types
  (so prefill and decode land on the machines meant for them); `--ray-placement-strategy` is
  Ray's (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD). A group the cluster cannot place within
  `--ray-placement-timeout` seconds (an autoscaler may be starting nodes for it) ends the launch
  with what it asked for and what the cluster has;
- one WorkerHost actor per bundle (ray_host.py), which runs the worker process on its node with
  that node's address as `--host`: control messages and state pages go over ZMQ / NCCL between
  the machines, never through Ray's object store.

Supervision: every `_SUPERVISE_PERIOD` s each actor is asked whether its worker still runs.  A
worker that exited, or whose actor died (node lost), is marked dead in the router at once (its
requests end with a 503) and started again under a new id (`d0` -> `d0.1`: a new process, new
sockets, new NCCL pairings; its old id stays dead in /health) on a fresh actor in the same
bundle, at most `--ray-max-restarts` times per worker.  Stopping stops every worker (SIGTERM,
then SIGKILL), kills the actors and removes the placement group.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

from pd_ssm.orchestrator.launcher import LaunchError, worker_args
from pd_ssm.orchestrator.local import LocalDeployment
from pd_ssm.orchestrator.ray_host import WorkerHost
from pd_ssm.router.workers import WorkerHandle, WorkerPool
from pd_ssm.worker.transfer_flags import CLUSTER_TOKEN_ENV

log = logging.getLogger("pd_ssm.serve.ray")

PREFILL_RESOURCE = "pd_prefill"  # custom resources of deploy/cluster.yaml's node types
DECODE_RESOURCE = "pd_decode"
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_SUPERVISE_PERIOD = 0.5  # seconds between checks of the workers
_POLL_TIMEOUT = 10.0  # seconds an actor may take to answer a check before it is asked again
_STOP_GRACE = 5.0  # seconds a worker gets after SIGTERM
_WAIT_LOG_PERIOD = 10.0  # seconds between "still waiting for placement" lines


@dataclass(frozen=True, slots=True)
class RayOptions:
    address: str | None = None  # None: $RAY_ADDRESS, a cluster running on this machine, else a new local one
    strategy: str = "PACK"
    cpus_per_worker: float = 1.0
    role_resources: bool = False
    max_restarts: int = 3
    placement_timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--ray-placement-strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.cpus_per_worker <= 0:
            raise ValueError(f"--ray-cpus-per-worker must be > 0, got {self.cpus_per_worker}")
        if self.max_restarts < 0:
            raise ValueError(f"--ray-max-restarts must be >= 0, got {self.max_restarts}")
        if self.placement_timeout <= 0:
            raise ValueError(f"--ray-placement-timeout must be > 0, got {self.placement_timeout}")


def bundle_for(dep: LocalDeployment, opts: RayOptions, worker_id: str) -> dict[str, float]:
    """The resources one worker's bundle asks for."""
    bundle: dict[str, float] = {"CPU": opts.cpus_per_worker}
    if dep.device == "cuda":
        bundle["GPU"] = 1.0
    if opts.role_resources and dep.disagg:
        bundle[PREFILL_RESOURCE if worker_id[0] == "p" else DECODE_RESOURCE] = 1.0
    return bundle


@dataclass(slots=True)
class _Slot:
    """One bundle of the placement group and the worker that runs in it."""

    base_id: str  # the worker's first id; restarts append ".N"
    bundle: dict[str, float]
    index: int  # bundle index
    worker_id: str = ""
    actor: Any = None  # the WorkerHost actor handle
    restarts: int = 0
    given_up: bool = False


class RayLauncher:
    """WorkerLauncher over a Ray cluster (see the module's docstring)."""

    def __init__(self, dep: LocalDeployment, opts: RayOptions) -> None:
        if dep.gpus is not None:
            raise ValueError("--gpus does not go with --ray: Ray assigns each worker its GPU")
        self.dep, self.opts = dep, opts
        self.slots: list[_Slot] = []
        self.pg: Any = None
        self.token = ""
        self._router_address = ""
        self._host_class: Any = None
        try:
            import ray
        except ImportError as e:
            raise LaunchError("pd-ssm serve --ray needs Ray on this machine and every node: "
                              "pip install 'pd-ssm[ray]'") from e
        self._ray = ray
        # NOTE: log_to_driver: each worker's log lines (its process writes to the actor's stdout and
        # stderr) come back to this process's console, prefixed with the actor, as local workers' do
        ray.init(address=opts.address, namespace="pd_ssm", log_to_driver=True)

    def control_host(self) -> str:
        # the address this node has in the cluster: workers on other nodes send to it
        return str(self._ray.util.get_node_ip_address())

    def describe(self) -> str:
        nodes = sum(1 for n in self._ray.nodes() if n.get("Alive"))
        return f"on a Ray cluster of {nodes} node(s)"

    # --- start ---------------------------------------------------------------------------
    def start(self, pool: WorkerPool, token: str) -> None:
        from ray.exceptions import RayError
        from ray.util.placement_group import placement_group

        self.token, self._router_address = token, pool.address
        self._host_class = self._ray.remote(WorkerHost)
        self.slots = [_Slot(w, bundle_for(self.dep, self.opts, w), i) for i, w in enumerate(pool.workers)]
        # a name of its own: several deployments may share a cluster (`ray list placement-groups` shows it)
        self.pg = placement_group([s.bundle for s in self.slots], strategy=self.opts.strategy,
                                  name=f"pd_ssm_serve_{os.getpid()}_{secrets.token_hex(3)}")
        self._wait_placed()
        for slot in self.slots:
            slot.actor = self._new_actor(slot)
        # the actors start in parallel: ask all, then read the answers
        wait = self.opts.placement_timeout
        try:
            places = self._ray.get([s.actor.place.remote() for s in self.slots], timeout=wait)
            starts = [s.actor.start.remote(*self._command(s.base_id, ip, pid))
                      for s, (ip, pid) in zip(self.slots, places, strict=True)]
            worker_pids = self._ray.get(starts, timeout=wait)
        except RayError as e:  # an actor that died or never answered: nothing is served half-started
            raise LaunchError(f"starting the workers' Ray actors failed: {e}") from e
        for slot, (ip, _), worker_pid in zip(self.slots, places, worker_pids, strict=True):
            slot.worker_id = slot.base_id
            pool.workers[slot.worker_id].pid = worker_pid
            log.info("started worker %s (pid %d) on node %s, bundle %s", slot.worker_id, worker_pid, ip, slot.bundle)

    def _wait_placed(self) -> None:
        deadline = time.monotonic() + self.opts.placement_timeout
        need = _total([s.bundle for s in self.slots])
        while True:
            left = deadline - time.monotonic()
            ready, _ = self._ray.wait([self.pg.ready()], timeout=max(0.0, min(left, _WAIT_LOG_PERIOD)))
            if ready:
                return
            have = {k: v for k, v in self._ray.available_resources().items() if k in need}
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"the Ray cluster could not place {len(self.slots)} worker(s) ({self.opts.strategy}: "
                    f"{_fmt([s.bundle for s in self.slots])}; {_fmt([need])} in all) within "
                    f"{self.opts.placement_timeout:g} s; it has {_fmt([have])} available "
                    f"(more nodes, fewer workers, --ray-cpus-per-worker, or --ray-placement-timeout)")
            log.info("waiting for the Ray cluster to place %d worker(s): need %s, available %s",
                     len(self.slots), _fmt([need]), _fmt([have]))

    def _new_actor(self, slot: _Slot) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        extra = {k: v for k, v in slot.bundle.items() if k not in ("CPU", "GPU")}
        return self._host_class.options(
            num_cpus=slot.bundle["CPU"], num_gpus=slot.bundle.get("GPU", 0.0), resources=extra,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=slot.index),
            name=None, max_restarts=0,
        ).remote()

    def _command(self, worker_id: str, node_ip: str, actor_pid: int) -> tuple[list[str], dict[str, str]]:
        argv = worker_args(self.dep, worker_id, self._router_address, actor_pid, host=node_ip)
        env = {CLUSTER_TOKEN_ENV: self.token} if self.dep.disagg else {}
        return argv, env

    # --- supervise ------------------------------------------------------------------------
    async def supervise(self, pool: WorkerPool) -> None:
        while True:
            checks = await asyncio.gather(*(self._check(slot, pool) for slot in self.slots if not slot.given_up),
                                          return_exceptions=True)
            for e in checks:  # one slot's surprise must not end the supervision of the others
                if isinstance(e, Exception):
                    log.error("supervising the Ray workers: %r", e)
            await asyncio.sleep(_SUPERVISE_PERIOD)

    async def _check(self, slot: _Slot, pool: WorkerPool) -> None:
        from ray.exceptions import RayActorError, RayError

        actor_alive = True
        try:
            code = await asyncio.wait_for(slot.actor.poll.remote(), _POLL_TIMEOUT)  # an ObjectRef is awaitable
        except RayActorError as e:
            actor_alive, code = False, None
            reason = f"its Ray actor died ({type(e).__name__})"
        except (asyncio.TimeoutError, RayError):
            return  # a slow or unreachable node: asked again next round; /health shows a hung worker
        if actor_alive:
            if code is None:
                return
            reason = "process " + (f"killed by signal {-code}" if code < 0 else f"exited with code {code}")
        log.error("worker %s: %s", slot.worker_id, reason)
        pool.mark_dead(slot.worker_id, reason)
        if slot.restarts >= self.opts.max_restarts:
            slot.given_up = True
            log.error("worker %s: not restarted (--ray-max-restarts %d reached)", slot.base_id, self.opts.max_restarts)
            return
        slot.restarts += 1
        await self._restart(slot, pool, actor_alive)

    async def _restart(self, slot: _Slot, pool: WorkerPool, actor_alive: bool) -> None:
        from ray.exceptions import RayError

        if not actor_alive:
            self._ray.kill(slot.actor, no_restart=True)
            slot.actor = self._new_actor(slot)
        worker_id = f"{slot.base_id}.{slot.restarts}"
        try:
            ip, actor_pid = await slot.actor.place.remote()
            worker_pid = await slot.actor.start.remote(*self._command(worker_id, ip, actor_pid))
        except RayError as e:  # the actor died again before its worker started: the next check retries
            log.error("restart of %s as %s failed: %s", slot.base_id, worker_id, e)
            return
        slot.worker_id = worker_id
        pool.workers[worker_id] = WorkerHandle(worker_id, pid=worker_pid)
        log.info("restarted worker %s as %s (pid %d) on node %s (restart %d of %d)", slot.base_id, worker_id,
                 worker_pid, ip, slot.restarts, self.opts.max_restarts)

    # --- stop -------------------------------------------------------------------------------
    def stop(self) -> None:
        from ray.exceptions import GetTimeoutError, RayError
        from ray.util.placement_group import remove_placement_group

        live = [s for s in self.slots if s.actor is not None]
        try:
            self._ray.get([s.actor.stop.remote(_STOP_GRACE) for s in live], timeout=_STOP_GRACE + 10)
        except (RayError, GetTimeoutError) as e:  # a dead actor's worker exits on its own (--parent-pid)
            log.warning("stopping workers: %s", e)
        for s in live:
            self._ray.kill(s.actor, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self._ray.shutdown()


def _total(bundles: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + v
    return total


def _fmt(bundles: list[dict[str, float]]) -> str:
    return ", ".join("{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(b.items())) + "}" for b in bundles)
