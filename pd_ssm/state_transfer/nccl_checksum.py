"""Checksums of the NCCL connector's p2p buffer, computed where the buffer lives (GPU or CPU).

zlib.crc32 would need every byte on the host: on CUDA that is a device->host copy of the whole
request (168 MB for Mamba2-2.7B), as slow as the transfer itself. Instead the buffer is cut into
BLOCK-byte blocks and one reduction kernel sums each block's 32-bit words into an int64. The
sender's kernel writes its sums into the message itself, a trailer after the requests' bytes
(`trailer_bytes`), so they travel with the bytes and nothing waits for them on the sender's host;
the receiver sums what arrived the same way and compares, per run, its sums with the trailer's
over the blocks the run occupies (8 bytes per 64 KiB, 0.01% of the payload, come to its host).
The sums are exact integers (at most 16384 words of |w| <= 2**31 per block: |sum| < 2**45, no
overflow), so CPU and CUDA give identical results. A run's header (layers, name, dtype, shape,
offset, length) carries its own crc32 in the metadata (nccl_message.py).

Why 64 KiB blocks, where the ZMQ wire (checksum.py) sums 4 KiB ones: the per-request host work is
what limits this connector (the link moves 168 MB in ~0.55 ms); the CPU sums here are
checksum.py's, added up 16 at a time.

What it catches: any single flipped bit (it changes its block's sum), truncated, shifted, stale
or zeroed data, swapped or repeated blocks (each block compared in place), a mangled trailer (it
no longer matches). What it misses: words permuted inside one block, and errors that cancel
inside a block -- transport errors of that shape are not what we guard against; NCCL and TCP
have their own link checks.

Layout contract with nccl_message: every run starts at a BLOCK-aligned offset and each
request's part is a multiple of BLOCK; the gap after a run is zero-filled by the sender and is
covered by that run's block sums.
"""

from __future__ import annotations

import numpy as np
import torch

from pd_ssm.state_transfer import checksum
from pd_ssm.state_transfer.checksum import sums_bytes
from pd_ssm.state_transfer.nccl_pinned import PinnedPool

# NOTE: also the alignment of every run in the coalesced buffer (so a run's sums are its own)
BLOCK = 64 << 10
_PER_BLOCK = BLOCK // checksum.BLOCK  # checksum.py's 4 KiB sums added up per block here


def align(n: int) -> int:
    """`n` rounded up to a multiple of BLOCK."""
    return -(-n // BLOCK) * BLOCK


def trailer_bytes(payload: int) -> int:
    """Bytes of the sums trailer after a `payload`-byte (a BLOCK multiple) message: 8 per block, padded to a block."""
    return align(payload // BLOCK * 8)


def write_sums(payload: torch.Tensor, trailer: torch.Tensor) -> None:
    """Sender: the block sums of `payload` into the first 8 bytes per block of `trailer` (queued on
    the current stream behind whatever wrote the payload; on the CPU at once). Both uint8 views."""
    n = payload.numel() // BLOCK * 8
    # NOTE: the trailer's alignment padding goes on the wire too: zeros, not whatever the buffer
    # held. On the CPU through numpy: torch's zero_ there woke its thread pool, ~0.65 ms a message
    # on a 2-core machine (nccl_host_cpu.py's profile), for a few KiB
    if payload.device.type == "cpu":
        trailer.numpy()[n:] = 0
    else:
        trailer[n:].zero_()
    if n == 0:
        return
    if payload.device.type == "cpu":
        trailer.numpy()[:n] = np.frombuffer(block_sums(payload), dtype=np.uint8)
    else:
        from pd_ssm.state_transfer.block_sums_triton import block_sums_triton

        block_sums_triton(payload, out=trailer[:n].view(torch.int64))


def same_sums(mine: bytes, theirs: bytes, offset: int, nbytes: int) -> bool:
    """Whether the blocks of [offset, align(offset + nbytes)) summed the same on both sides."""
    first, last = offset // BLOCK * 8, align(offset + nbytes) // BLOCK * 8
    return mine[first:last] == theirs[first:last]


def block_sums(buf: torch.Tensor) -> bytes:
    """Per-block sums of `buf`'s int32 words, as little-endian int64 bytes on the host.

    buf: uint8 [n], n a multiple of BLOCK, on any device (one reduction kernel, one small copy)."""
    return PendingSums(buf).wait()


class PendingSums:
    """Block sums on their way to the host, with `trailer` (the sender's sums, received) if given.
    On CUDA: one kernel queued on the current stream behind whatever wrote the buffer -- it also
    copies the trailer's sums beside ours -- and one copy of both into pinned memory (from `pool`,
    given back once read; a fresh buffer without one) without blocking the host. On the CPU they
    are computed at once (numpy's integer reduction is ~10x torch's there; the same integers).
    `theirs` holds the trailer's first 8 bytes per block of `buf`: all that `same_sums` compares."""

    def __init__(self, buf: torch.Tensor, trailer: torch.Tensor | None = None, pool: PinnedPool | None = None) -> None:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() % BLOCK:
            raise ValueError(
                f"block_sums needs a 1-D uint8 buffer whose length is a multiple of {BLOCK}, "
                f"got {buf.dtype} {tuple(buf.shape)}"
            )
        self._blocks = buf.numel() // BLOCK
        self._bytes: bytes | None = None
        self._theirs = b""
        self._host: torch.Tensor | None = None  # pinned int64: our sums, then the trailer's if it came
        self._with_trailer = trailer is not None
        self._pool = pool
        self._done: torch.cuda.Event | None = None
        if trailer is not None and trailer.numel() < 8 * self._blocks:
            raise ValueError(f"a trailer of {trailer.numel()} bytes cannot hold the sums of {self._blocks} blocks")
        if buf.numel() == 0:
            self._bytes = b""
        elif buf.device.type == "cpu":
            small = checksum.host_block_sums(buf.numpy())
            self._bytes = sums_bytes(small.reshape(-1, _PER_BLOCK).sum(axis=1))
            self._theirs = b"" if trailer is None else trailer[: 8 * self._blocks].numpy().tobytes()
        else:
            from pd_ssm.state_transfer.block_sums_triton import block_sums_triton

            sums = block_sums_triton(buf, theirs=trailer)  # [blocks] or [2 * blocks] int64
            n = sums.numel()
            self._host = pool.take(n) if pool is not None else torch.empty(n, dtype=torch.int64, pin_memory=True)
            self._host[:n].copy_(sums, non_blocking=True)
            self._done = torch.cuda.current_stream(buf.device).record_event()

    def ready(self) -> bool:
        return self._bytes is not None or (self._done is not None and self._done.query())

    def wait(self) -> bytes:
        """The sums as little-endian int64 bytes (blocks until the device produced them)."""
        if self._bytes is None:
            assert self._done is not None and self._host is not None
            self._done.synchronize()
            words = self._host.numpy()
            self._bytes = sums_bytes(words[: self._blocks])
            if self._with_trailer:
                self._theirs = words[self._blocks : 2 * self._blocks].tobytes()  # the trailer's bytes as sent
            if self._pool is not None:
                self._pool.give(self._host)  # read: the next message may land in it
            self._host = self._done = None
        return self._bytes

    def theirs(self) -> bytes:
        """The trailer's bytes (after `wait`): the sender's sums as it wrote them."""
        self.wait()
        return self._theirs
