"""Block sums: the host half of the payload checksums both connectors use.

A payload is cut into BLOCK-byte blocks and each block's words are summed; a checksum is then
zlib.crc32 over a description of the payload followed by those sums (8 bytes per 4 KiB: 0.2% of
the payload). numpy's integer reductions drop the GIL and run at 5-16 GB/s a core, where crc32 over
every byte ran at 1.7-3.6 GB/s -- on loopback that was the ZMQ transfer's bottleneck.

`host_block_sums` (nccl_checksum's CPU path): each block's int32 words summed exactly into an int64
(at most 1024 words of |w| <= 2**31: |sum| < 2**41), so the CPU here and nccl_checksum's CUDA kernel
give the same integers.

`payload_checksum` (the ZMQ wire's; both peers run this code, so no device has to agree): each
block's uint64 words summed mod 2**64, then lane sums -- for each 8-byte offset within a block, the
sum mod 2**64 of the words at that offset over all blocks (4 KiB per payload). uint64 sums need no
widening, so both reductions together run at ~8 GB/s from memory, 1.6x the exact int32 sums alone.
A block sum alone misses two flips of one bit in opposite directions inside one block -- the very
errors a TCP checksum (also a sum) lets through; two changed words in one block sit in different
lanes, so an error that fools both views needs >= 4 changed words, in two blocks at the same two
offsets, whose changes cancel in both.

A payload whose length is not a multiple of BLOCK (or of the word size) counts as if zero-padded to
the next block: a flipped bit in its tail still changes the last block's sum.

Both sums split at block boundaries: block sums concatenate and lane sums add up, so a payload cut
into BLOCK-aligned pieces can be summed by several threads and checked from the pieces' sums
(`sum_shares`, `sum_share`, `gather_sums`, `checksum_of_sums`) -- the same checksum as in one pass.
A run frame of 32 MB is then summed by every thread of a pool, as a dozen page frames were.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, TypeVar

import numpy as np

BLOCK = 4096  # bytes
_WORDS = BLOCK // 4
_LANES = BLOCK // 8
_PAD_BELOW = 256 << 10  # bytes: a smaller payload with a partial block is summed from a padded copy
# bytes: a payload is cut into pieces for the pool no smaller than this (each piece costs a few
# numpy calls of GIL, ~10 us; 1 MiB sums in ~100 us)
_MIN_PIECE = 1 << 20
# bytes: ... and no larger than this, so a piece is still in cache when the lane sums read it again
# after the block sums (86 MB summed in 1-4 MB pieces: ~12% less CPU than in 16 MB ones)
_MAX_PIECE = 2 << 20

Buffer = bytes | bytearray | memoryview
_Item = TypeVar("_Item")


def align(n: int) -> int:
    """`n` rounded up to a multiple of BLOCK."""
    return -(-n // BLOCK) * BLOCK


class _Blocks(NamedTuple):
    full: np.ndarray  # uint8 [k * BLOCK]: the whole blocks, a view of the payload
    tail: np.ndarray | None  # uint8 [BLOCK]: the partial last block, zero-padded (a copy); None if none


def _raw(buf: Buffer | np.ndarray) -> np.ndarray:
    """The payload's bytes as a flat uint8 array (a view, no copy)."""
    return buf.reshape(-1).view(np.uint8) if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)


def _split(buf: Buffer | np.ndarray) -> _Blocks:
    raw = _raw(buf)
    full = raw.nbytes - raw.nbytes % BLOCK
    if full == raw.nbytes:
        return _Blocks(raw, None)
    tail = np.zeros(BLOCK, dtype=np.uint8)
    tail[: raw.nbytes - full] = raw[full:]
    return _Blocks(raw[:full], tail)


def host_block_sums(buf: Buffer | np.ndarray) -> np.ndarray:
    """Per-block int64 sums of `buf`'s int32 words (native order), the last block zero-padded.

    buf: any C-contiguous bytes-like object or ndarray of n bytes -> int64 [align(n) // BLOCK]."""
    return _block_sums(_split(buf))


def _block_sums(b: _Blocks) -> np.ndarray:
    nfull = b.full.nbytes // BLOCK
    sums = np.empty(nfull + (b.tail is not None), dtype=np.int64)
    if nfull:
        # NOTE: the int64 accumulator makes the sums exact; numpy releases the GIL in the loop
        np.add.reduce(b.full.view(np.int32).reshape(nfull, _WORDS), axis=1, dtype=np.int64, out=sums[:nfull])
    if b.tail is not None:
        sums[-1] = b.tail.view(np.int32).sum(dtype=np.int64)
    return sums


class WireSums(NamedTuple):
    """The wire's sums of one payload, or of one BLOCK-aligned piece of it (`sum_share`)."""

    blocks: np.ndarray  # uint64 [blocks]: wrapping sum of each block's 8-byte words
    lanes: np.ndarray  # uint64 [BLOCK // 8]: per offset within a block, the wrapping sum over blocks


def wire_sums(buf: Buffer | np.ndarray) -> WireSums:
    """uint64 [blocks] wrapping sums of each block's 8-byte words, and uint64 [BLOCK // 8] lane sums
    (per offset within a block, over every block); numpy's uint64 adds wrap mod 2**64, by design.

    NOTE: a frame pays this per payload, and small ones are many (a conv page is 32 KB, 7.9
    blocks): a payload below _PAD_BELOW is padded by one copy and summed in one pass, and the tail
    of a larger one goes into preallocated sums -- each numpy call costs microseconds of GIL."""
    raw = _raw(buf)
    n = raw.nbytes
    if 0 < n < BLOCK:
        # NOTE: one partial block (a request or end frame's body, ~200 B): its zero-padded words
        # are the lane sums, and their sum the block sum -- a third of the numpy calls below
        lanes = np.zeros(_LANES, dtype=np.uint64)
        lanes.view(np.uint8)[:n] = raw
        return WireSums(np.add.reduce(lanes, keepdims=True), lanes)
    rest = n % BLOCK
    if rest and n < _PAD_BELOW:
        padded = np.zeros(n - rest + BLOCK, dtype=np.uint8)
        padded[:n] = raw
        raw, n, rest = padded, padded.nbytes, 0
    nfull = n // BLOCK
    words = raw[: nfull * BLOCK].view(np.uint64).reshape(nfull, _LANES)  # [whole blocks, 512]
    blocks = np.empty(nfull + (rest > 0), dtype=np.uint64)
    np.add.reduce(words, axis=1, out=blocks[:nfull])
    lanes = np.add.reduce(words, axis=0)  # zeros if no whole block
    if rest:
        tail = np.zeros(BLOCK, dtype=np.uint8)
        tail[:rest] = raw[nfull * BLOCK :]
        tail_words = tail.view(np.uint64)
        blocks[nfull] = np.add.reduce(tail_words)
        lanes += tail_words
    return WireSums(blocks, lanes)


def sums_bytes(sums: np.ndarray) -> bytes:
    """The sums as little-endian int64 bytes: what the crc32 covers, the same on every host."""
    return sums.astype("<i8", copy=False).tobytes()


def payload_checksum(description: bytes, buf: Buffer | np.ndarray) -> int:
    """crc32 over `description` (the payload's identity: a header edited in transit fails too),
    then the little-endian block sums of `buf`, then its lane sums."""
    return checksum_of_sums(description, [wire_sums(buf)])


def checksum_of_sums(description: bytes, pieces: Sequence[WireSums]) -> int:
    """`payload_checksum` from the sums of the payload's pieces in order (`sum_shares`), each a
    whole number of blocks but the last: the crc32 runs on over each piece's block sums (as over
    their concatenation), and lane sums add up (mod 2**64) over pieces."""
    crc = zlib.crc32(description)
    if len(pieces) == 1:  # a frame summed in one pass: its lanes are the sum (no zeros to add to)
        crc = zlib.crc32(pieces[0].blocks.astype("<u8", copy=False).tobytes(), crc)
        return zlib.crc32(pieces[0].lanes.astype("<u8", copy=False).tobytes(), crc)
    lanes = np.zeros(_LANES, dtype=np.uint64)
    for piece in pieces:
        crc = zlib.crc32(piece.blocks.astype("<u8", copy=False).tobytes(), crc)
        lanes += piece.lanes
    return zlib.crc32(lanes.astype("<u8", copy=False).tobytes(), crc)


class Piece(NamedTuple):
    """Bytes [start, stop) of payload number `payload`; start a multiple of BLOCK."""

    payload: int
    start: int
    stop: int


def sum_shares(sizes: Sequence[int], n: int, min_piece: int = _MIN_PIECE) -> list[list[Piece]]:
    """The checksum work of payloads of `sizes` bytes, as at most `n` shares of about equal bytes
    for a pool of `n` threads: a payload larger than a share (or than _MAX_PIECE) is cut into
    BLOCK-aligned pieces, so one 32 MB run frame keeps every thread busy as well as 12 page
    frames did. Every payload has
    at least one piece (an empty one for an empty payload); in order, so the pieces of each
    payload are consecutive and ascending."""
    align_to = max(BLOCK, align(min_piece))
    piece = max(align_to, min(_MAX_PIECE, align(-(-sum(sizes) // max(n, 1)))))
    pieces = [Piece(i, start, min(start + piece, size)) for i, size in enumerate(sizes)
              for start in range(0, max(size, 1), piece)]
    return even_shares(pieces, n, lambda p: p.stop - p.start)


def sum_share(payloads: Sequence[Buffer], share: Sequence[Piece]) -> list[WireSums]:
    """One pool task: the sums of each piece of `share` (numpy drops the GIL while it sums)."""
    return [wire_sums(_raw(payloads[p.payload])[p.start : p.stop]) for p in share]


def gather_sums(count: int, shares: Sequence[Sequence[Piece]], results: Iterable[list[WireSums]]) -> list[list[WireSums]]:
    """Per payload (of `count`), its pieces' sums in order, from the shares' results."""
    out: list[list[WireSums]] = [[] for _ in range(count)]
    for share, sums in zip(shares, results, strict=True):
        for p, s in zip(share, sums, strict=True):
            out[p.payload].append(s)
    return out


def even_shares(items: list[_Item], n: int, size: Callable[[_Item], int]) -> list[list[_Item]]:
    """`items` in order, cut into at most `n` consecutive runs of about equal total `size` (bytes).

    How a connector spreads checksum work over a pool of `n` threads: one task per thread, not per
    tensor, since each task trades the GIL between the caller and a worker, and two threads trading
    it may each wait out the 5 ms switch interval."""
    total = sum(size(x) for x in items)
    runs: list[list[_Item]] = [[]]
    done = 0
    for x in items:
        if runs[-1] and len(runs) < n and done >= total * len(runs) / n:  # this run holds its share
            runs.append([])
        runs[-1].append(x)
        done += size(x)
    return [r for r in runs if r]
