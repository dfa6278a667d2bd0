"""The GPU block-sum kernel of the NCCL connector against its host sums (numpy, via checksum.py):
the same exact integers, on CPU through Triton's interpreter and on CUDA at a request's size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pd_ssm.state_transfer.block_sums_triton import block_sums_triton
from pd_ssm.state_transfer.nccl_checksum import (
    BLOCK,
    PendingSums,
    block_sums,
    same_sums,
    trailer_bytes,
    write_sums,
)
from pd_ssm.state_transfer.nccl_pinned import PinnedPool
from tests.conftest import needs_cuda

# Triton's interpreter on a machine without CUDA (tests/conftest.py), the GPU where there is one
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("blocks", [3, pytest.param(2600, marks=needs_cuda)])  # 2600: a 168 MB request
def test_kernel_sums_equal_the_host_sums(blocks: int) -> None:
    g = torch.Generator().manual_seed(blocks)
    buf = torch.randint(0, 256, (blocks * BLOCK,), dtype=torch.uint8, generator=g)
    buf[:BLOCK] = 0xFF  # a block of -1 words: negative sums must come out exact too
    buf[BLOCK : 2 * BLOCK] = torch.tensor([0x00, 0x00, 0x00, 0x80], dtype=torch.uint8).repeat(BLOCK // 4)  # -2**31
    want = np.frombuffer(block_sums(buf), dtype="<i8")
    words = buf.view(torch.int32).view(blocks, -1).to(torch.int64)  # the reference: plain int64 math
    assert want.tolist() == words.sum(dim=1).tolist()
    got = block_sums_triton(buf.to(DEV)).cpu().numpy()
    assert got.tolist() == want.tolist()
    assert want[0] == -(BLOCK // 4) and want[1] == -(BLOCK // 4) * 2**31


@needs_cuda
def test_block_sums_agree_across_devices() -> None:
    g = torch.Generator().manual_seed(9)
    buf = torch.randint(0, 256, (4 * BLOCK,), dtype=torch.uint8, generator=g)
    assert block_sums(buf) == block_sums(buf.cuda())


def test_the_receivers_launch_copies_the_trailer_beside_its_sums() -> None:
    """One launch a message on the receiver: [our sums | the trailer's], one copy to the host."""
    g = torch.Generator().manual_seed(5)
    payload = torch.randint(0, 256, (3 * BLOCK,), dtype=torch.uint8, generator=g)
    trailer = torch.randint(0, 256, (trailer_bytes(payload.numel()),), dtype=torch.uint8, generator=g)
    got = block_sums_triton(payload.to(DEV), theirs=trailer.to(DEV)).cpu()
    assert got.shape == (6,)
    assert got[:3].numpy().tobytes() == block_sums(payload)
    assert got[3:].numpy().tobytes() == trailer[:24].numpy().tobytes()


def test_the_senders_trailer_is_its_sums_then_zeros() -> None:
    """The trailer is padded to a whole block and all of it goes on the wire: past the sums, zeros
    (not what the reused buffer held before)."""
    g = torch.Generator().manual_seed(8)
    payload = torch.randint(0, 256, (3 * BLOCK,), dtype=torch.uint8, generator=g).to(DEV)
    trailer = torch.randint(1, 256, (trailer_bytes(payload.numel()),), dtype=torch.uint8, generator=g).to(DEV)
    write_sums(payload, trailer)
    got = trailer.cpu()
    assert got[:24].numpy().tobytes() == block_sums(payload)
    assert not got[24:].any()


@needs_cuda
def test_pending_sums_on_cuda_reuse_pinned_buffers() -> None:
    g = torch.Generator().manual_seed(6)
    pool = PinnedPool(keep=2)
    for blocks in (3, 3, 520):  # 520: 1040 sums, past the smallest buffer (1024 words)
        payload = torch.randint(0, 256, (blocks * BLOCK,), dtype=torch.uint8, generator=g)
        buf = torch.cat([payload, torch.zeros(trailer_bytes(payload.numel()), dtype=torch.uint8)])
        write_sums(buf[: payload.numel()], buf[payload.numel() :])
        buf[7] ^= 0x01  # arrived different: ours differ from the trailer in block 0 only
        on_cpu = PendingSums(buf[: payload.numel()], buf[payload.numel() :])
        on_gpu = PendingSums(buf[: payload.numel()].cuda(), buf[payload.numel() :].cuda(), pool)
        assert (on_gpu.wait(), on_gpu.theirs()) == (on_cpu.wait(), on_cpu.theirs())
        assert not same_sums(on_gpu.wait(), on_gpu.theirs(), 0, BLOCK)
        assert same_sums(on_gpu.wait(), on_gpu.theirs(), BLOCK, (blocks - 1) * BLOCK)
    assert pool.allocated == 2 and len(pool) == 2  # the second 3-block message reused the first's
