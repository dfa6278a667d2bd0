"""ZmqConfig: what the ZMQ connector is configured with, on both sides (zmq_connector.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(slots=True)
class ZmqConfig:
    token: str  # the cluster token; both peers hold the same one
    send_timeout: float = 5.0  # seconds a message may wait for the peer to accept it
    sndhwm: int = 8  # messages (a whole request, or one streamed piece) ZMQ queues per peer
    rcvhwm: int = 8  # and on the receive side
    linger_ms: int = 1000  # how long close() may wait to flush accepted messages
    # a whole request leaves in messages of about this many payload bytes, so the receiver checks
    # one while the next is on the wire and the sender checksums the next while ZMQ sends one
    message_bytes: int = 32 << 20
    # ... except its first and last messages: the wire waits for the first one's checksums and the
    # receiver checks the last one after the wire is done, so sizes ramp up from this (doubling)
    # and down to it at the end (_message_sizes)
    edge_message_bytes: int = 2 << 20
    # frames checksummed in parallel on each side (numpy's sums drop the GIL): ~7 GB/s a core, so
    # two outrun the socket (~3-4 GB/s). NOTE: more cost the prefill process dearly: every thread
    # takes the GIL back between numpy calls, and a host-bound eager forward streaming its layers
    # waits for it at every launch -- on the H200 host, 2048 tokens streamed took 171.6 / 144.7 /
    # 123.6 ms (start -> pages in) with 8 / 2 / 1 threads, and with 2 the bench's throughput rows
    # were all >= 0.77x the socket (RESULTS.md session 4)
    checksum_threads: int = field(default_factory=lambda: min(2, os.cpu_count() or 1))
    # a receiver makes glibc keep up to this many freed bytes for reuse (process-wide, see the
    # module docstring; < 2 GiB: mallopt takes an int); None: leave malloc alone (e.g. not glibc)
    malloc_retain_bytes: int | None = 1 << 30

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("ZmqConfig.token is empty: peers authenticate with the shared cluster token")
        positive = (self.send_timeout, self.sndhwm, self.rcvhwm, self.message_bytes, self.edge_message_bytes,
                    self.checksum_threads)
        retain = self.malloc_retain_bytes
        if min(positive) <= 0 or self.linger_ms < 0 or (retain is not None and not 0 < retain < 1 << 31):
            raise ValueError(
                "ZmqConfig: send_timeout, sndhwm, rcvhwm, message_bytes, edge_message_bytes, checksum_threads must be > 0, "
                f"linger_ms >= 0 and malloc_retain_bytes None or in (0, 2**31) (mallopt takes an int): {self}"
            )
