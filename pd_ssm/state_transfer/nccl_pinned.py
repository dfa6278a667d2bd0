"""PinnedPool: page-locked host buffers the NCCL receiver's block sums land in, reused message
after message.

Why: the sums of each message come to the host by a non-blocking copy, which needs pinned
memory; `torch.empty(pin_memory=True)` per message (two, with the trailer's) was a measurable
part of the ~0.35 ms a message the receiver's host spent queueing its sums on the H200. A message's
sums are a few KiB (16 bytes per 64 KiB block: 42 KiB for a 168 MB request), so a handful of
buffers covers every message in flight.

Contract: `take` hands out a buffer no one else holds; the caller gives it back with `give` only
after the copy into it completed and its bytes were read (PendingSums.wait), so a reused buffer
is never written while read. One not given back (its message dropped mid-flight) is freed by
torch as any tensor, after its pending copy (the host allocator records it).
"""

from __future__ import annotations

import torch

_MIN_WORDS = 1 << 10  # int64 words: the smallest buffer (8 KiB); sizes go up in powers of two


class PinnedPool:
    def __init__(self, keep: int = 8, pin: bool = True) -> None:
        """`keep`: free buffers held at most; `pin`: False only in CPU-only tests (no CUDA to pin with)."""
        if keep <= 0:
            raise ValueError(f"a PinnedPool keeps at least one buffer, got keep={keep}")
        self.keep = keep
        self.pin = pin
        self._free: list[torch.Tensor] = []  # int64 [capacity], capacity a power of two >= _MIN_WORDS
        self.allocated = 0  # buffers made (not counting reuse): how well the pool works

    def __len__(self) -> int:
        return len(self._free)

    def take(self, words: int) -> torch.Tensor:
        """A pinned int64 buffer of at least `words` words (slice it: it may be longer), the
        smallest free one that fits, else a new one."""
        fits = [i for i, t in enumerate(self._free) if t.numel() >= words]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        self.allocated += 1
        size = max(_MIN_WORDS, 1 << max(0, words - 1).bit_length())
        return torch.empty(size, dtype=torch.int64, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        """`buf` (from `take`, its bytes read) free for the next message; past `keep`, the smallest goes."""
        self._free.append(buf)
        if len(self._free) > self.keep:
            # NOTE: by index: list.remove would compare tensors elementwise
            self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))
