"""The NCCL connector's block sums on the GPU: one Triton program per 4 KiB block.

`words.sum(dim=1, dtype=torch.int64)` -- the obvious torch form -- first converts the whole buffer
to int64 (a second, twice as large copy of a 168 MB request) and cost ~0.9 ms of host time per
request on the H200 (benchmarks/profile_transfer_gpu.py), which alone capped the connector near a
quarter of the link. Here each program reads its block's 1024 int32 words once and writes one
exact int64 sum (at most 1024 words of |w| <= 2**31: no overflow), the same integers as
checksum.host_block_sums.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from pd_ssm.state_transfer.checksum import BLOCK

_WORDS = BLOCK // 4


@triton.jit
def _block_sums_kernel(words_ptr, out_ptr, WORDS: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    w = tl.load(words_ptr + block * WORDS + tl.arange(0, WORDS))
    tl.store(out_ptr + block, tl.sum(w.to(tl.int64), axis=0))


def block_sums_triton(buf: torch.Tensor) -> torch.Tensor:
    """int64 [n // BLOCK] per-block sums of a 1-D uint8 buffer's int32 words (n a multiple of
    BLOCK, n > 0), on the buffer's device, asynchronous."""
    blocks = buf.numel() // BLOCK
    out = torch.empty(blocks, dtype=torch.int64, device=buf.device)
    # NOTE: Triton launches on the current CUDA device, which need not be the buffer's
    with torch.cuda.device(buf.device) if buf.is_cuda else nullcontext():
        _block_sums_kernel[(blocks,)](buf.view(torch.int32), out, WORDS=_WORDS, num_warps=4)
    return out

