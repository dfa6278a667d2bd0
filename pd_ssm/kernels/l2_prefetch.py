"""L2 prefetch hints: a kernel's programs, done with their own work, ask L2 for the bytes that the next
kernel of the step reads first.

Why: at a kernel boundary the memory pipe drains. The last programs of one kernel finish their
streams one by one, and the next kernel's programs read nothing until the whole grid before them has
completed (their PDL gate, pdl.py): three plain streaming launches a layer lost 6.5-10.8 us a layer to
their boundaries against one launch streaming the same bytes (benchmarks/handoff_gpu.py, RESULTS.md
session 22). A weight the next kernel streams does not depend on anything in flight, so a program
that has stored its outputs spends a few instructions asking L2 for a slice of it: the tail of one
kernel then fills the drain with the head of the next, and the next kernel's first loads hit L2.
A prefetch changes no value, only when bytes move; it needs no registers (unlike loading the weights
before the gate, which costs the next kernel occupancy: session 20).

Where it pays (engine A/B calls on an H200, 2.7B shape, RESULTS.md session 23), at one row:
  - out_proj + add's programs ask for the first 512 bytes of each row of the next block's in_proj
    weight (5.4 MB): the batch-1 step 1.766-1.768 -> 1.727-1.732 ms; 256 and 768 bytes within a few
    us of it, 1024 and 2048 less good;
  - in_proj + conv's programs ask for the first 1024 bytes of out_proj's rows: 1.748-1.751 -> 1.742-1.747
    (4096 bytes, all that out_proj loads before its gate, the same).
At 2-32 rows (RESULTS.md session 24), the split-K GEMM of out_proj + add (160 programs of 64 columns)
asks for the first 1024 bytes of each row of the next in_proj, what its DOT tile's first four K slices
read: batch 32 4.876-4.895 -> 4.818-4.832 ms, batch 8 2.818-2.822 -> 2.751-2.752 (512 bytes: 4.825-4.831
and 2.765-2.766; 256: 4.861-4.863 and 2.784-2.787).
What lost: the same hint from that boundary's reduce launch instead (160 programs asking for 67 rows
each: the batch-32 step 4.89 -> 4.95 ms at 512 bytes, 5.09 at 1024), and bulk prefetches
(`cp.async.bulk.prefetch.L2`, one a row) in place of line prefetches: 1.79 -> 1.82 / 1.91 / 2.09 ms at
512 / 1024 / 2048 bytes, as if a program's exit waited for its bulk copies.

The prefetch itself is l2_prefetch_triton.py's. GPU only: Triton's interpreter cannot run inline
assembly, so on CPU tensors the hint is dropped, and tests compare outputs with and without it on the
GPU. The references take the hint and ignore it.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

LINE_BYTES = 128  # what one prefetch asks L2 for: the line holding the address
# the head of the next block's in_proj weight a block boundary asks for, per row (layers/mixer2.py):
# at one row, for in_proj's GEMV; at more, for its DOT tile (in_proj_conv_triton.py)
NEXT_WEIGHT_HEAD_BYTES = 512
NEXT_WEIGHT_TILE_HEAD_BYTES = 1024
# the head of out_proj's weight in_proj asks for, per row (layers/mixer2.py)
OUT_PROJ_HEAD_BYTES = 1024


class L2Rows(NamedTuple):
    """The first `head_bytes` of each row of `t` [rows, K] (stride 1 on K), never past a row's end:
    what a kernel streaming t along K reads first."""

    t: Tensor
    head_bytes: int


def check_hint(kernel: str, hint: L2Rows) -> None:
    t, head = hint
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{kernel}: an L2Rows hint takes a 2-D tensor with stride 1 on its last axis; got shape "
                         f"{tuple(t.shape)}, strides {t.stride()}")
    if head <= 0:
        raise ValueError(f"{kernel}: L2Rows.head_bytes must be positive; got {head}")
