"""The SSD scan's launch plan from shapes and config alone (no tensors): which state path, which
chunk the kernels scan in, how many logical chunks the grid must cover, block sizes.

ssd_triton.py launches by it; every function here is pure and tested without a GPU.
"""

from __future__ import annotations

from pd_ssm.kernels.ssd_config import SSDConfig


def pow2(n: int) -> int:
    """The least power of two >= n (triton.next_power_of_2 without its constexpr-function call)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_logical_chunks(num_tokens: int, num_seqs: int, chunk_size: int) -> int:
    """Upper bound on the logical chunks of any batch of this size, from shapes alone.

    A sequence of n tokens spans at most ceil(n / Q) + 1 chunks (one more for a mid-chunk start),
    and ceil(n / Q) <= (n - 1) // Q + 1; summed: (T - S) // Q + 2 S. No chunk is empty: <= T.
    """
    return min(num_tokens, (num_tokens - num_seqs) // chunk_size + 2 * num_seqs)


def block(n: int, cap: int) -> int:
    # tl.dot needs every dimension >= 16
    return max(16, min(cap, pow2(n)))


def serial_step(chunk: int, cap: int) -> tuple[int, int]:
    """(tokens a step, tile rows) of the serial state kernel: steps of a power of two (>= 16 for
    tl.dot, <= cap) that divides the chunk, else the whole chunk in one tile of its padded size."""
    bk = block(chunk, cap)
    if bk < chunk and chunk % bk == 0:
        return bk, bk
    return chunk, pow2(max(chunk, 16))


def use_serial_states(cfg: SSDConfig, num_tokens: int, num_seqs: int, max_seqlen: int | None) -> bool:
    """Whether chunk states and their passing run as the serial kernel (else the two kernels).

    The serial kernel takes as long as its longest walk, so it pays only where every sequence is
    short: the longest one at most `serial_max_tokens`. Without `max_seqlen` (reading cu_seqlens
    would sync the host) the average T / S stands in for it, a lower bound: one long sequence among
    many short ones then runs serially too (H200: 7680 + 512 tokens 1.3x slower that way).
    """
    if not cfg.state_serial:
        return False
    if max_seqlen is None:
        return num_tokens <= num_seqs * cfg.serial_max_tokens
    return max_seqlen <= cfg.serial_max_tokens


def kernel_chunk(cfg: SSDConfig, chunk_size: int, serial: bool, num_tokens: int, num_seqs: int) -> int:
    """The chunk the kernels scan in: the model's, or on the serial path cfg.serial_chunk where that
    is smaller, divides it, and the sequences average at least two of them. The result is the same
    function of the inputs either way (the chunking is the algorithm's, not the model's); boundary
    states stay at the model's multiples.

    A smaller chunk shortens the scan's causal part (about Q / 2 sources a row) and adds states
    entering chunks (T / Q of them). The serial path stores only those (in the dot dtype) and gains
    at 128 against 256 (H200, 2.7B shapes, benchmarks/RESULTS.md, session 14): 10-13% from 32 x 256
    to 16 x 1024 tokens; but 64 x 128 tokens lose 9% (sequences of one or two chunks either way).
    The two-kernel path also writes and reads every chunk's own fp32 state, and gains nothing.
    """
    small = cfg.serial_chunk
    fits = small < chunk_size and chunk_size % small == 0 and num_tokens >= 2 * small * num_seqs
    return small if serial and fits else chunk_size
