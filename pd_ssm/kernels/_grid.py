"""Plain-int launch arithmetic for the Triton launchers: grid sizes and power-of-two blocks.

triton.cdiv and triton.next_power_of_2 are constexpr functions: called from the host each goes
through Triton's JIT call machinery, 2-6 us a call on the lent hosts (cProfile of an eager decode
step, benchmarks/host_profile_engine_gpu.py, session 17), nine of them in a decode layer's launches.
"""

from __future__ import annotations


def pow2(n: int) -> int:
    """The least power of two >= n: triton.next_power_of_2, except 1 (not 0) for n = 0, a block
    size every tl.arange takes."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for b > 0, as triton.cdiv."""
    return -(-a // b)
