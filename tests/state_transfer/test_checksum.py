"""checksum.py: exact per-4-KiB int32 block sums (the NCCL connector's CPU path adds them up), the
wire's uint64 block and lane sums, the tail zero-padded; work shares for checksum pools."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from pd_ssm.state_transfer import nccl_checksum
from pd_ssm.state_transfer.checksum import (
    BLOCK,
    align,
    checksum_of_sums,
    even_shares,
    gather_sums,
    host_block_sums,
    payload_checksum,
    sum_share,
    sum_shares,
    sums_bytes,
)


def ref_sums(raw: bytes) -> list[int]:
    """Pure-Python reference: pad to a whole block, sum each block's signed little-endian int32 words."""
    padded = raw + b"\0" * (align(len(raw)) - len(raw))
    words = [int.from_bytes(padded[i : i + 4], "little", signed=True) for i in range(0, len(padded), 4)]
    per = BLOCK // 4
    return [sum(words[i : i + per]) for i in range(0, len(words), per)]


@pytest.mark.parametrize("n", [0, 1, 3, 4, 4095, 4096, 4097, 3 * 4096 + 6])
def test_sums_match_the_reference(n: int) -> None:
    raw = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert host_block_sums(raw).tolist() == ref_sums(raw)


def test_extreme_words_are_exact() -> None:
    # 1024 words of INT32_MIN / INT32_MAX: the int64 accumulator must not wrap
    lo = np.full(1024, np.iinfo(np.int32).min, dtype=np.int32).tobytes()
    hi = np.full(1024, np.iinfo(np.int32).max, dtype=np.int32).tobytes()
    assert host_block_sums(lo + hi).tolist() == [1024 * -(2**31), 1024 * (2**31 - 1)]


def test_every_buffer_kind_gives_the_same_sums() -> None:
    t = torch.randn(3, 1500)  # 18000 B: a partial last block
    raw = t.numpy().tobytes()
    want = host_block_sums(raw).tolist()
    assert host_block_sums(memoryview(t.numpy())).tolist() == want  # a float-format memoryview
    assert host_block_sums(t.numpy()).tolist() == want
    assert host_block_sums(bytearray(raw)).tolist() == want
    assert host_block_sums(memoryview(raw)[:]).tolist() == want


def ref_wire_sums(raw: bytes) -> tuple[list[int], list[int]]:
    """Pure-Python reference of the wire's sums: per block, and per 8-byte offset within a block,
    the sum mod 2**64 of the little-endian uint64 words."""
    padded = raw + b"\0" * (align(len(raw)) - len(raw))
    blocks, lanes = [0] * (len(padded) // BLOCK), [0] * (BLOCK // 8)
    for i in range(0, len(padded), 8):
        word = int.from_bytes(padded[i : i + 8], "little")
        blocks[i // BLOCK] = (blocks[i // BLOCK] + word) % 2**64
        lanes[(i % BLOCK) // 8] = (lanes[(i % BLOCK) // 8] + word) % 2**64
    return blocks, lanes


# NOTE: payloads below 64 blocks with a partial last block are summed from a padded copy, larger
# ones with the tail apart: both paths are checked against the reference
@pytest.mark.parametrize("n", [0, 1, 13, 2 * BLOCK, 2 * BLOCK + 13, 63 * BLOCK + 5, 64 * BLOCK, 64 * BLOCK + 13])
def test_payload_checksum_is_crc32_of_description_block_sums_then_lane_sums(n: int) -> None:
    raw = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    blocks, lanes = ref_wire_sums(raw)
    want = zlib.crc32(np.array(blocks, dtype="<u8").tobytes(), zlib.crc32(b"desc"))
    want = zlib.crc32(np.array(lanes, dtype="<u8").tobytes(), want)
    assert payload_checksum(b"desc", raw) == want
    assert payload_checksum(b"desd", raw) != want


def test_lane_sums_catch_flips_that_cancel_in_a_block_sum() -> None:
    words = np.zeros(2 * 1024, dtype=np.int32)
    words[5] = 1  # word 5 loses bit 0, word 9 gains it: both block sums are unchanged
    bad = words.copy()
    bad[5], bad[9] = 0, 1
    assert host_block_sums(words.tobytes()).tolist() == host_block_sums(bad.tobytes()).tolist()
    assert ref_wire_sums(words.tobytes())[0] == ref_wire_sums(bad.tobytes())[0]
    assert payload_checksum(b"", words.tobytes()) != payload_checksum(b"", bad.tobytes())


def test_nccl_cpu_path_builds_on_the_shared_sums() -> None:
    nblock = nccl_checksum.BLOCK  # a multiple of ours: its sums add ours up
    buf = torch.randint(0, 256, (3 * nblock,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ours = host_block_sums(buf.numpy()).reshape(-1, nblock // BLOCK).sum(axis=1)
    assert nccl_checksum.block_sums(buf) == sums_bytes(ours)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_even_shares_keep_order_and_balance(n: int) -> None:
    sizes = [5, 1, 1, 7, 3, 3, 2, 8, 1, 1]
    runs = even_shares(sizes, n, lambda x: x)
    assert [x for r in runs for x in r] == sizes and 1 <= len(runs) <= n and all(runs)
    if n == 2:
        assert runs == [[5, 1, 1, 7, 3], [3, 2, 8, 1, 1]]  # 17 and 15 of 32
    assert even_shares([], n, lambda x: x) == []


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_pieces_summed_in_shares_give_the_whole_payloads_checksum(n: int) -> None:
    """Payloads cut into BLOCK-aligned pieces, summed share by share (as a pool does) and gathered:
    each payload's checksum equals the one summed whole, tails and empty payloads included."""
    rng = np.random.default_rng(n)
    sizes = [0, 13, 5 * BLOCK, 37 * BLOCK + 5, 3 * BLOCK + 4095, 100 * BLOCK]
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes]
    shares = sum_shares(sizes, n, min_piece=BLOCK)
    assert 1 <= len(shares) <= n
    pieces = [p for share in shares for p in share]
    for i, size in enumerate(sizes):  # each payload covered once, in order, cut at block boundaries
        mine = [(p.start, p.stop) for p in pieces if p.payload == i]
        assert mine[0][0] == 0 and mine[-1][1] == size and all(a[1] == b[0] for a, b in zip(mine, mine[1:], strict=False))
        assert all(start % BLOCK == 0 for start, _ in mine)
    sums = gather_sums(len(payloads), shares, [sum_share(payloads, share) for share in shares])
    for raw, piece_sums in zip(payloads, sums, strict=True):
        assert checksum_of_sums(b"id", piece_sums) == payload_checksum(b"id", raw)
    if n == 8:
        assert max(len(s) for s in sums) > 1  # the largest payload really was cut


def test_shares_keep_pieces_no_smaller_than_asked() -> None:
    shares = sum_shares([64 * BLOCK], 8, min_piece=32 * BLOCK)
    assert [[(p.start, p.stop) for p in share] for share in shares] == [[(0, 32 * BLOCK)], [(32 * BLOCK, 64 * BLOCK)]]
    assert sum_shares([], 4) == []
