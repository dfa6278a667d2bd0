"""WorkerHost: the Ray actor that holds one worker's place on a node and runs its process there.

Ray places the actor (its placement-group bundle: CPUs, the GPU, the role's resource); the actor
starts the same `python -m pd_ssm.<role>` process the local launcher starts, on its node, so the
engine runs outside Ray's worker process (its signals, its stdout, its CUDA context are its own)
and no state ever goes through the object store.  What the actor adds:

- the node's address as the worker's `--host`, so its command and data sockets are reachable
  from the router and the other workers on other machines;
- the GPU Ray assigned it: Ray sets CUDA_VISIBLE_DEVICES in the actor's environment, which the
  process inherits (and OMP_NUM_THREADS to the bundle's CPUs);
- its own pid as the worker's `--parent-pid`: when the actor dies (killed, node lost) the worker
  exits instead of holding the device.

This module imports no Ray at import time: ray.py wraps the class with `ray.remote`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


class WorkerHost:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def place(self) -> tuple[str, int]:
        """(this node's address in the cluster, this actor's pid): the worker's --host and --parent-pid."""
        import ray

        return str(ray.util.get_node_ip_address()), os.getpid()

    def start(self, args: list[str], env: dict[str, str]) -> int:
        """Start the worker: this node's Python with `args` (launcher.worker_args, given this node's
        address and this actor's pid); `env` is added to the actor's environment.  Its pid."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"this host already runs a worker (pid {self.proc.pid})")
        self.proc = subprocess.Popen([sys.executable, *args], env={**os.environ, **env}, stdin=subprocess.DEVNULL)
        return self.proc.pid

    def poll(self) -> int | None:
        """The worker's exit status (negative: killed by that signal), or None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace: float) -> int | None:
        """SIGTERM, then SIGKILL after `grace` s; returns the exit status (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
