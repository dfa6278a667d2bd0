"""The NCCL connector's block sums on the GPU: one Triton program per 64 KiB block.

`words.sum(dim=1, dtype=torch.int64)` -- the obvious torch form -- first converts the whole buffer
to int64 (a second, twice as large copy of a 168 MB request) and cost ~0.9 ms of host time per
request on the H200 (benchmarks/profile_transfer_gpu.py), which alone capped the connector near a
quarter of the link. Here each program reads its block's 16384 int32 words once, 1024 at a time,
and writes one exact int64 sum (|sum| < 2**45: no overflow), the integers nccl_checksum's CPU
path computes.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from pd_ssm.kernels.launch import FastKernel

_WORDS = 16384  # int32 words per 64 KiB block (nccl_checksum.BLOCK)
_CHUNK = 1024  # words loaded at a time


@triton.jit
def _block_sums_kernel(
    words_ptr, out_ptr, theirs_ptr,  # pointers: int32 words, int64 sums out, int64 trailer in
    blocks,  # dimensions: 64 KiB blocks of `words_ptr`
    WORDS: tl.constexpr, CHUNK: tl.constexpr, COPY_THEIRS: tl.constexpr,  # meta-parameters
):
    block = tl.program_id(0).to(tl.int64)
    base = words_ptr + block * WORDS
    acc = tl.zeros([CHUNK], dtype=tl.int64)
    for i in tl.static_range(WORDS // CHUNK):
        acc += tl.load(base + i * CHUNK + tl.arange(0, CHUNK)).to(tl.int64)
    tl.store(out_ptr + block, tl.sum(acc, axis=0))
    if COPY_THEIRS:  # the received trailer's sum of this block, beside ours: one copy to the host
        tl.store(out_ptr + blocks + block, tl.load(theirs_ptr + block))


_BLOCK_SUMS = FastKernel(_block_sums_kernel)


def block_sums_triton(
    buf: torch.Tensor, out: torch.Tensor | None = None, theirs: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 [n // 64 KiB] per-block sums of a 1-D uint8 buffer's int32 words (n a multiple of
    64 KiB, n > 0), on the buffer's device, asynchronous; into `out` (int64 [n // 64 KiB], same
    device, contiguous: the sender's trailer) if given.

    `theirs` (the receiver): the received trailer, uint8 [>= 8 * (n // 64 KiB)] on the same device;
    then the result is int64 [2 * (n // 64 KiB)]: our sums, then the trailer's first n // 64 KiB
    sums -- one launch and one device->host copy a message, not one of each per half."""
    blocks = buf.numel() // (4 * _WORDS)
    want = blocks if theirs is None else 2 * blocks
    if out is None:
        out = torch.empty(want, dtype=torch.int64, device=buf.device)
    assert out.shape == (want,) and out.dtype == torch.int64 and out.device == buf.device and out.is_contiguous()
    if theirs is not None:
        assert theirs.dtype == torch.uint8 and theirs.dim() == 1 and theirs.numel() >= 8 * blocks
        assert theirs.device == buf.device and theirs.is_contiguous()
        theirs = theirs[: 8 * blocks].view(torch.int64)  # NOTE: 8-aligned: the trailer starts at a block
    # NOTE: Triton launches on the current CUDA device, which need not be the buffer's
    with torch.cuda.device(buf.device) if buf.is_cuda else nullcontext():
        _BLOCK_SUMS[(blocks,)](
            buf.view(torch.int32), out, out if theirs is None else theirs, blocks,
            WORDS=_WORDS, CHUNK=_CHUNK, COPY_THEIRS=theirs is not None, num_warps=4,
        )
    return out

