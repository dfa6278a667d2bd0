"""The sender's half of pairing with an NCCL connector's receiver ("Pairing and recovery" in
nccl_connector.py): join the receiver's rendezvous store, take a new generation, greet the receiver
over the side channel, build that generation's p2p group; and the store probe that tells a sender
its receiver dropped the pairing.

No request state here: NcclSender decides when to pair and what a lost pairing fails.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import zmq

from pd_ssm.state_transfer.nccl_config import NcclConfig
from pd_ssm.state_transfer.nccl_control import Control
from pd_ssm.state_transfer.nccl_group import (
    ADDRESS_KEY,
    GEN_KEY,
    SENDER_RANK,
    PeerGroup,
    dropped_key,
    join_store,
)

_PROBE_TIMEOUT = 1.0  # seconds a liveness probe of the rendezvous store may take


class Pairing(NamedTuple):
    address: str  # the receiver's side-channel address
    push: zmq.Socket  # PUSH to it (the caller closes it)
    group: PeerGroup  # the p2p group of this generation
    probe: dist.TCPStore  # the receiver's store, with a short timeout (`dropped`)


def pair_with(rendezvous: str, config: NcclConfig, ctx: zmq.Context, device: torch.device) -> Pairing:
    """Pair with the receiver whose store listens at `rendezvous`; RuntimeError (saying why) if it
    cannot be joined, does not take the hello within `send_timeout`, or the group's handshake fails."""
    try:
        store = join_store(rendezvous, config.timeout)
        address = store.get(ADDRESS_KEY).decode()
        gen = store.add(GEN_KEY, 1)
        push = push_socket(ctx, address, config.send_timeout)
        try:
            try:
                push.send_multipart([config.token.encode(), Control.hello(gen).encode()])
            except zmq.Again:
                raise RuntimeError(f"receiver {address} did not take the hello within {config.send_timeout} s") from None
            group = PeerGroup(store, gen, SENDER_RANK, device, config.timeout)
            # NOTE: a store client retries a lost server until its timeout: probes must not stall a dead peer's sender
            probe = join_store(rendezvous, min(_PROBE_TIMEOUT, config.timeout))
        except BaseException:
            push.close()
            raise
    except (RuntimeError, ValueError) as e:  # c10d raises RuntimeError (DistStoreError) on timeouts
        raise RuntimeError(f"pairing with the receiver at {rendezvous} failed: {e}") from e
    return Pairing(address, push, group, probe)


def push_socket(ctx: zmq.Context, address: str, send_timeout: float) -> zmq.Socket:
    """The side channel to `address`: a send the peer does not take within `send_timeout` raises
    zmq.Again, and nothing queues for a peer that is not connected."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDTIMEO, int(send_timeout * 1000))
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # only onto a live connection: a dead peer -> Again
    sock.connect(address)
    return sock


def dropped(probe: dist.TCPStore, gen: int) -> str | None:
    """One store round trip: why the receiver dropped generation `gen`, or None if it did not."""
    key = dropped_key(gen)
    try:
        if not probe.check([key]):
            return None
        return probe.get(key).decode()
    except RuntimeError as e:  # the store went with its receiver
        return f"rendezvous store unreachable: {e}"
