"""Host -> device copies that do not make the host wait for the GPU.

From pageable host memory the driver stages a copy through its own pinned buffer and may wait for
the stream to drain before it does (CUDA's API synchronization behaviour), `non_blocking` or not:
a host that waits there cannot queue the next decode step while the current one runs. From pinned
memory the copy is queued and the host goes on (with these copies the host's graph launch calls
came 0.6-3.7 ms before the GPU reached them, benchmarks/RESULTS.md session 21). torch's pinned
allocator caches its blocks and keeps each one until the copies that read it have run (it
records an event on the copy's stream), so a fresh pinned tensor per copy is a cached allocation,
never reused early.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def copy_from_host(dst: Tensor, src: Tensor) -> None:
    """dst.copy_(src) for a host tensor `src`, queued without waiting when dst is on a GPU."""
    if dst.is_cuda and not src.is_pinned():
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)


def host_values(values: Sequence[int | float | bool], dtype: torch.dtype, device: torch.device) -> Tensor:
    """torch.tensor(values, dtype=dtype, device=device), queued without waiting on a GPU."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
