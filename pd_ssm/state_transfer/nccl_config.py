"""NcclConfig: what both roles of the NCCL connector are configured with (addresses from config,
never fixed; port 0 in `rendezvous` lets the receiver pick a free one)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pd_ssm.state_transfer.nccl_group import split_tcp


@dataclass(slots=True)
class NcclConfig:
    token: str  # the cluster token; both peers hold the same one
    rendezvous: str  # receiver: "tcp://host:port" its store listens on (port 0: free); sender: that address
    device: str = "cpu"  # where p2p buffers live: "cpu" -> gloo, "cuda:N" -> nccl
    timeout: float = 30.0  # seconds: pairing, and a p2p op from its post to its completion
    send_timeout: float = 5.0  # seconds the metadata may wait for the peer to accept it
    recv_device: str | None = None  # where received tensors go; None: `device` (views, no copy)
    # receiver: bytes of p2p recvs posted ahead of the request being checked (at least one is)
    recv_window: int = 1 << 30
    # receiver: the largest message it allocates for (a 2.7B request is 0.17 GB; long hybrid KV more)
    max_message_bytes: int = 64 << 30
    # sender: requests held while the link is busy go out as one message once they reach this many
    # tensor bytes (nccl_batch.py): 2 fp32 / 3 bf16 Mamba2-2.7B requests, a message's link time
    # (~0.75 ms) above the hosts' per-message work, small enough that laying it out does not idle
    # the link (RESULTS.md session 7). A message of several never passes max_message_bytes (block
    # padding and the sums trailer, ~0.01%, on top)
    coalesce_bytes: int = 256 << 20
    # sender: layer-wise streaming (the engine hands over each layer as its prefill forward
    # finishes it, which rules out prefill CUDA graphs); off: each request whole, after the forward
    stream_layers: bool = False
    # sender, streaming: layers go as one part once they reach this many bytes (a 2.6 MB message
    # per layer reaches ~92 GB/s on the H200 pair, TARGETS.md): ~5 parts per fp32 2.7B request.
    # 64 MB parts were no faster in a burst of 8 (RESULTS.md session 7: the per-layer host work
    # dominates there), and what is left after the prefill (at most this much) takes longer
    stream_bytes: int = 32 << 20
    # sender, streaming: while a data message went less than this many seconds ago, host layers
    # (no `ready` event) collect up to coalesce_bytes before they make a part: a burst of requests
    # handed over layer by layer then travels in few, large entries, as whole requests do, where
    # 32 MB parts left the link waiting on the hosts' per-entry work (RESULTS.md session 10).
    # Layers a prefill hands over while it computes come milliseconds apart, in stream_bytes parts
    part_hold: float = 2e-3
    backend: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("NcclConfig.token is empty: peers authenticate with the shared cluster token")
        split_tcp(self.rendezvous)
        if self.part_hold < 0:
            raise ValueError(f"NcclConfig.part_hold must be >= 0 seconds, got {self.part_hold}")
        if min(self.timeout, self.send_timeout, self.recv_window, self.max_message_bytes, self.coalesce_bytes,
               self.stream_bytes) <= 0:
            raise ValueError(
                "NcclConfig: timeout, send_timeout, recv_window, max_message_bytes, coalesce_bytes, stream_bytes "
                f"must be > 0: {self}"
            )
        kind = torch.device(self.device).type
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"NcclConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        self.backend = "nccl" if kind == "cuda" else "gloo"
