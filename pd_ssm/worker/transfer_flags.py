"""Flags and connector construction shared by the prefill and decode worker processes.

The cluster token never travels on a command line (where `ps` shows it): the launcher puts it in
the environment variable CLUSTER_TOKEN_ENV of every worker it starts.
"""

from __future__ import annotations

import argparse
import os

CLUSTER_TOKEN_ENV = "PD_SSM_CLUSTER_TOKEN"


def add_transfer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connector", default="zmq", choices=["zmq", "nccl"],
                   help="how state pages move prefill -> decode (nccl: gloo on --device cpu)")
    p.add_argument("--transfer-timeout", type=float, default=30.0,
                   help="seconds: NCCL pairing and p2p ops; reservations expire after it as well")
    p.add_argument("--send-timeout", type=float, default=5.0,
                   help="seconds a message may wait for its peer to accept it before the transfer fails")
    p.add_argument("--stream-layers", action="store_true",
                   help="nccl: prefill workers send each layer's pages as the forward finishes it (in parts; "
                        "the prefill then runs eager, without CUDA graphs); zmq always streams")
    p.add_argument("--stream-bytes", type=int, default=32 << 20,
                   help="nccl with --stream-layers: a part leaves once it holds this many bytes of layers")
    p.add_argument("--max-unsent", type=int, default=64,
                   help="prefill workers: requests without a decode worker's ticket held at most; past it, new "
                        "prefill requests wait on the host, so their state pages do not pile up on the GPU "
                        "while every decode worker is full")


def cluster_token() -> str:
    token = os.environ.get(CLUSTER_TOKEN_ENV, "")
    if not token:
        raise SystemExit(f"{CLUSTER_TOKEN_ENV} is not set: prefill and decode workers authenticate each other "
                         f"with it (the launcher sets it; by hand, export the same random string to both)")
    return token


def transfer_device(device: str) -> str:
    """Where NCCL buffers live: the engine's device ("cuda" -> the current GPU: the launcher makes
    one GPU visible per worker)."""
    return "cuda:0" if device == "cuda" else device
