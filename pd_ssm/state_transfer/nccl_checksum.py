"""Checksums of the NCCL connector's coalesced buffer, computed where the buffer lives (GPU or CPU).

zlib.crc32 would need every byte on the host: on CUDA that is a device->host copy of the whole
request (168 MB for Mamba2-2.7B), as slow as the transfer itself. Instead the buffer is cut into
BLOCK-byte blocks and one reduction kernel sums each block's 32-bit words into an int64; only those
sums (8 bytes per 64 KiB, 0.01% of the payload) come to the host, where a run's checksum is the
crc32 of the sums of the blocks it occupies. The sums are exact integers (at most 16384 words of
|w| <= 2**31 per block: |sum| < 2**45, no overflow), so CPU and CUDA give identical results.

Why 64 KiB blocks, where the ZMQ wire (checksum.py) sums 4 KiB ones: the per-request host work is
what limits this connector (the link moves 168 MB in ~0.55 ms), and with 4 KiB blocks the crc32
over the sums alone took ~0.1 ms a side; the CPU sums here are checksum.py's, added up 16 at a time.

What it catches: any single flipped bit (it changes its block's sum), truncated, shifted, stale
or zeroed data, swapped or repeated blocks (the crc32 is over the ordered sums). What it misses:
words permuted inside one block, and errors that cancel inside a block -- transport errors of that
shape are not what we guard against; NCCL and TCP have their own link checks.

Layout contract with nccl_message: every run starts at a BLOCK-aligned offset and the buffer
length is a multiple of BLOCK; the gap after a run is zero-filled by the sender and is covered by
that run's checksum, as is the run's header (layers, name, dtype, shape, offset, length).
"""

from __future__ import annotations

import zlib

import torch

from pd_ssm.state_transfer import checksum
from pd_ssm.state_transfer.checksum import sums_bytes

# NOTE: also the alignment of every run in the coalesced buffer (so a run's sums are its own)
BLOCK = 64 << 10
_PER_BLOCK = BLOCK // checksum.BLOCK  # checksum.py's 4 KiB sums added up per block here


def align(n: int) -> int:
    """`n` rounded up to a multiple of BLOCK."""
    return -(-n // BLOCK) * BLOCK


def block_sums(buf: torch.Tensor) -> bytes:
    """Per-block sums of `buf`'s int32 words, as little-endian int64 bytes on the host.

    buf: uint8 [n], n a multiple of BLOCK, on any device (one reduction kernel, one small copy)."""
    return PendingSums(buf).wait()


class PendingSums:
    """Block sums on their way to the host. On CUDA: one kernel queued on the device's current
    stream behind whatever wrote the buffer, copied into pinned memory without blocking the host
    (a sender must not stall on its own pack kernel while the link could take the previous
    request). On the CPU they are computed at once (numpy's integer reduction is ~10x torch's
    there; the same integers)."""

    def __init__(self, buf: torch.Tensor) -> None:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() % BLOCK:
            raise ValueError(
                f"block_sums needs a 1-D uint8 buffer whose length is a multiple of {BLOCK}, "
                f"got {buf.dtype} {tuple(buf.shape)}"
            )
        self._bytes: bytes | None = None
        self._host: torch.Tensor | None = None
        self._done: torch.cuda.Event | None = None
        if buf.numel() == 0:
            self._bytes = b""
        elif buf.device.type == "cpu":
            small = checksum.host_block_sums(buf.numpy())
            self._bytes = sums_bytes(small.reshape(-1, _PER_BLOCK).sum(axis=1))
        else:
            from pd_ssm.state_transfer.block_sums_triton import block_sums_triton

            sums = block_sums_triton(buf)
            self._host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            self._host.copy_(sums, non_blocking=True)
            self._done = torch.cuda.current_stream(buf.device).record_event()

    def ready(self) -> bool:
        return self._bytes is not None or (self._done is not None and self._done.query())

    def wait(self) -> bytes:
        """The sums as little-endian int64 bytes (blocks until the device produced them)."""
        if self._bytes is None:
            assert self._done is not None and self._host is not None
            self._done.synchronize()
            self._bytes = sums_bytes(self._host.numpy())
            self._host = self._done = None
        return self._bytes


def tensor_checksum(sums: bytes, offset: int, nbytes: int, header: bytes) -> int:
    """crc32 over the tensor's `header` (its description: a header edited in transit or by a buggy
    sender fails too), then the block sums of [offset, align(offset + nbytes)) (offset BLOCK-aligned)."""
    first, last = offset // BLOCK, align(offset + nbytes) // BLOCK
    return zlib.crc32(sums[first * 8 : last * 8], zlib.crc32(header))
