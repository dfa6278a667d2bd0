"""PeerGroup: the NCCL connector's own two-rank process group, outside torch.distributed's world.

Why not `init_process_group` / `new_group`: the default group is one per process, and `new_group`
needs one that spans every rank, so a connector that used either would own torch.distributed for
the whole process (no tensor-parallel group, no second connector) and could not be rebuilt after a
peer died. Instead the backend object is constructed directly from a store --
`ProcessGroupGloo(store, rank, 2, timeout)` / `ProcessGroupNCCL(store, rank, 2, options)`, the
same public constructors torch.distributed's own `_new_process_group_helper` calls in 2.11-2.13
(tested here on 2.13 with gloo) -- and used through `Backend.send` / `Backend.recv`. Such a group
is invisible to torch.distributed's registry: it coexists with a default group and with other
connectors' groups, and dies with its last reference.

Rendezvous: the receiver (decode side) hosts a TCPStore -- it is the long-lived side that tickets
already point to -- and publishes its ZMQ data address in it. A sender takes a fresh generation
number with `store.add`, and each generation's group keys live under their own prefix, so a
restarted sender (or receiver store) never meets keys of a dead group.

Failure: a dead gloo peer closes its sockets, so pending p2p raise "Connection closed by peer"
at once; a dead NCCL peer makes p2p hang, so every wait is bounded and the survivor aborts the
communicator. NCCL's own watchdog would otherwise tear the whole process down on a comm error
(TORCH_NCCL_ASYNC_ERROR_HANDLING defaults to 3); our group is built with handling 0 -- errors
are ours to handle -- and a watchdog timeout well above our waits.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

SENDER_RANK, RECEIVER_RANK = 0, 1
GEN_KEY = "pd_ssm/nccl/generation"
ADDRESS_KEY = "pd_ssm/nccl/address"


def dropped_key(gen: int) -> str:
    """Set by the receiver when it drops generation `gen`: how the sender learns of it (the
    side channel is one-way, and a gloo send completes once its bytes are in the socket)."""
    return f"pd_ssm/nccl/gen{gen}/dropped"
_WATCHDOG_FACTOR = 4  # NCCL's watchdog fires this many connector timeouts after a stuck op


def split_tcp(url: str) -> tuple[str, int]:
    """("host", port) of "tcp://host:port"; a clear error for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"expected 'tcp://host:port', got {url!r}")
    return parts.hostname, parts.port


def host_store(rendezvous: str, timeout: float) -> dist.TCPStore:
    """The receiver's store server; port 0 binds a free port (`store.port` says which)."""
    host, port = split_tcp(rendezvous)
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )


def join_store(rendezvous: str, timeout: float) -> dist.TCPStore:
    """A sender's client of the receiver's store; raises if none answers within `timeout`."""
    host, port = split_tcp(rendezvous)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


POLL_S = 20e-6  # seconds between completion polls of an NCCL p2p (a query of its CUDA event)


class PeerGroup:
    """Generation `gen` of the group between one sender (rank 0) and one receiver (rank 1).

    Construction blocks until the peer constructs the same generation and one handshake p2p
    went through (RuntimeError otherwise, after at most about `timeout`)."""

    def __init__(self, store: dist.Store, gen: int, rank: int, device: torch.device, timeout: float) -> None:
        self.gen = gen
        self.rank = rank
        self.peer = RECEIVER_RANK if rank == SENDER_RANK else SENDER_RANK
        self.nccl = device.type == "cuda"
        prefix = dist.PrefixStore(f"pd_ssm/nccl/gen{gen}/", store)
        self._pg: Any
        if self.nccl:
            self._pg = _nccl_group(prefix, rank, timeout)
        else:
            self._pg = dist.ProcessGroupGloo(prefix, rank, 2, timedelta(seconds=timeout))
        # NOTE: one tiny p2p now: NCCL creates its communicator on the first p2p, so this keeps
        # that (blocking, collective) setup inside the pairing, and proves the group carries bytes
        probe = torch.full((1,), gen if rank == SENDER_RANK else -1, dtype=torch.int64, device=device)
        work = self.isend(probe) if rank == SENDER_RANK else self.irecv(probe)
        why = self.wait(work, timeout)
        if why is None and int(probe.item()) != gen:
            why = f"handshake carried {int(probe.item())}, expected generation {gen}"
        if why is not None:
            self.close()
            raise RuntimeError(f"generation {gen}: the group formed but its handshake failed: {why}")

    def isend(self, buf: torch.Tensor) -> Any:
        """Post the p2p send of `buf` (keep `buf` alive until the work completed)."""
        return self._pg.send([buf], self.peer, 0)

    def irecv(self, buf: torch.Tensor) -> Any:
        return self._pg.recv([buf], self.peer, 0)

    def done(self, work: Any) -> bool | None:
        """Whether `work` completed, without blocking; None where the backend cannot tell (gloo's
        p2p Work reports completion only through `wait`, and a timed-out wait ends it)."""
        return bool(work.is_completed()) if self.nccl else None

    def wait(self, work: Any, timeout: float) -> str | None:
        """Block until `work` completes: None if it did, else why not (peer gone, timed out).

        NCCL: poll the work's completion event ourselves every POLL_S, then `wait()` without a
        timeout (returns at once, surfaces an error). A wait *with* a timeout sleeps between its own
        polls in coarse steps, which cost milliseconds per request: more than moving 168 MB over
        NVLink. After a failure the group is unusable: the p2p stream may hold half a message."""
        try:
            if self.nccl:
                end = time.monotonic() + timeout
                while not work.is_completed():
                    if time.monotonic() > end:
                        return f"timed out after {timeout:.1f} s"
                    time.sleep(POLL_S)
                work.wait()
                return None
            ok = work.wait(timedelta(seconds=max(timeout, 0.001)))
        except RuntimeError as e:
            return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return None if ok else f"timed out after {timeout:.1f} s"

    def close(self) -> None:
        """Tear the group down. NCCL: abort the communicator (ops stuck on a dead peer never
        finish on their own). Gloo: dropping it closes its sockets, failing the peer's pending ops."""
        if self.nccl:
            self._pg.abort()
        self._pg = None


def _nccl_group(store: dist.Store, rank: int, timeout: float) -> Any:
    if not dist.is_nccl_available():
        raise RuntimeError("this torch build has no NCCL: use device='cpu' (gloo) or a CUDA build of torch")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout * _WATCHDOG_FACTOR)
    # NOTE: the handling mode is read once, in the constructor; restore the caller's setting after
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    before = os.environ.get(key)
    os.environ[key] = "0"
    try:
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before
