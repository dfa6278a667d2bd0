"""Sampled tokens (and logprobs) still on the device, and their one trip to the host.

The sampler leaves its results here instead of reading them at once, so that a step can be
launched, the next one scheduled and launched behind it, and only then the first one's tokens
read (async scheduling, engine/inflight.py).  On CUDA `start_copy` queues device->host copies
into pinned memory and records an event behind them; `host()` waits for that event only.  On the
CPU the tensors are already on the host and both are plain reads.

A greedy step's tokens need no copy: the argmax kernel writes them into a pinned buffer of a
`HostTokenRing` as well (a device->host copy behind it cost 8.6 us of GPU time between two
kernels, benchmarks/RESULTS.md session 21).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class SamplerOutput(NamedTuple):
    token_ids: list[int]  # [N], one per logits row
    logprobs: list[dict[int, float] | None]  # [N]: {token_id: raw logprob}, top-n then the sampled token


class LogprobParts(NamedTuple):
    """Raw logprobs of the L rows that asked for them (row order of `rows`)."""

    rows: list[int]  # [L] sampled rows that want logprobs
    counts: list[int]  # [L] how many top logprobs each row wants
    sampled: Tensor  # [L] fp32, logprob of the sampled token
    top_values: Tensor  # [L, n_max] fp32, highest first
    top_ids: Tensor  # [L, n_max] int64


class DeviceSample:
    """One step's sampled tokens [N] (int64, on the logits' device) and logprobs, host copy pending."""

    def __init__(self, tokens: Tensor, logprobs: LogprobParts | None, host_tokens: Tensor | None = None) -> None:
        self.tokens = tokens  # [N] int64; the next step may feed these to the model on the device
        self.logprobs = logprobs
        # [N] int64 pinned, written by the sampling kernels themselves (then no logprobs): no copy
        self._host_tokens = host_tokens
        self._host: list[Tensor] | None = None
        self._event: torch.cuda.Event | None = None
        self._read: SamplerOutput | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def _device_tensors(self) -> list[Tensor]:
        lp = self.logprobs
        return [self.tokens] if lp is None else [self.tokens, lp.sampled, lp.top_values, lp.top_ids]

    def start_copy(self) -> DeviceSample:
        """Queue the device->host copies behind the sampling kernels (no wait); idempotent."""
        if self._host is not None:
            return self
        tensors = self._device_tensors()
        if self._host_tokens is not None:  # written by the kernels: nothing to copy
            self._host = [self._host_tokens]
        elif self.tokens.device.type != "cuda":
            self._host = tensors
        else:
            # NOTE: pinned, or a non_blocking copy to the host would be synchronous anyway
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in tensors]
        if self.tokens.device.type != "cuda":
            return self
        self._event = torch.cuda.Event()
        self._event.record()
        return self

    def host(self) -> SamplerOutput:
        """The tokens and logprob dicts as Python values; waits for the copies (starts them if needed).
        Read once: later calls return the same values."""
        if self._read is not None:
            return self._read
        self.start_copy()
        assert self._host is not None
        if self._event is not None:
            self._event.synchronize()
        token_ids: list[int] = self._host[0].tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(token_ids)
        lp = self.logprobs
        if lp is not None:
            sampled, top_lp, top_ids = (t.tolist() for t in self._host[1:])
            for j, (i, n) in enumerate(zip(lp.rows, lp.counts, strict=True)):
                d = dict(zip(top_ids[j][:n], top_lp[j][:n], strict=True))
                d.setdefault(token_ids[i], sampled[j])
                logprobs[i] = d
        self._read = SamplerOutput(token_ids, logprobs)
        return self._read


class HostTokenRing:
    """SLOTS pinned int64 buffers that greedy steps' tokens are written into by the argmax kernel.

    A buffer is handed out again only after the sample that used it was read (`DeviceSample.host`,
    which keeps its values): a sample read late never sees a later step's tokens, and a kernel never
    writes a buffer whose values are still unread. With async scheduling a sample is read one step
    after its launch, so taking a buffer never waits in practice.
    """

    SLOTS = 4

    def __init__(self, pin: bool = True) -> None:
        self._pin = pin  # False only in tests without CUDA (pinning needs it)
        self._bufs: list[Tensor | None] = [None] * self.SLOTS
        self._users: list[DeviceSample | None] = [None] * self.SLOTS
        self._next = 0

    def take(self, n: int) -> tuple[int, Tensor]:
        """(slot, a pinned [n] int64 buffer): bind the sample that uses it with `bind(slot, sample)`."""
        slot = self._next
        self._next = (slot + 1) % self.SLOTS
        user = self._users[slot]
        if user is not None:
            user.host()  # its values kept before the buffer is reused
            self._users[slot] = None
        buf = self._bufs[slot]
        if buf is None or buf.shape[0] < n:
            buf = self._bufs[slot] = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=self._pin)
        return slot, buf[:n]

    def bind(self, slot: int, sample: DeviceSample) -> None:
        self._users[slot] = sample
