"""Triton greedy argmax: each row of the logits split over several programs.

torch.argmax over [N, 50280] fp32 took 12.3-13.3 us of GPU time at 1, 32 and 128 rows on the H200;
this kernel takes 2.7 / 4.4 / 7.5 us there (benchmarks/RESULTS.md, session 21). That is on every
decode step's tail, after the lm_head. One program a row streamed a row from one SM: 7-9 us.

Each of a row's `SPLIT` programs keeps a running (largest value, its index) per lane over its
part's blocks and reduces its lanes: the largest value and, among the lanes holding it, the
smallest index. A lane only takes a value strictly larger than the one it holds and sees its
indices in increasing order, so it holds the first index of its own maximum. The program stores
its part's pair and draws a ticket (an atomic count per row); the program that draws the last
ticket reduces the row's parts the same way, writes the token and sets the ticket back to zero
for the next call. NaN counts as +inf (torch: the first NaN wins; a row holding both +inf and NaN
gives here the first of either).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._device import on_device
from pd_ssm.kernels._grid import cdiv
from pd_ssm.kernels.argmax import check_host_out, check_logits
from pd_ssm.kernels.launch import FastKernel

BLOCK = 512
MAX_SPLIT = 64
# NOTE: programs a row fall with the rows: 64 at 1 row, 16 at 32, 8 from 64 on (session 21's sweep)
PROGRAMS = 512


@triton.jit
def _take(x_row, i, hi, best, best_i):
    """The lanes' running (largest value, its first index) after the block at indices i (those < hi
    counted); a NaN counts as +inf."""
    x = tl.load(x_row + i, mask=i < hi, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    take = x > best  # NOTE: strict: a lane keeps the first index of its maximum
    return tl.where(take, x, best), tl.where(take, i, best_i)


@triton.jit
def _first_max(best, best_i, none):
    """(largest value, smallest index holding it) over the lanes; `none` exceeds every index."""
    m = tl.max(best, axis=0)
    return m, tl.min(tl.where(best == m, best_i, none), axis=0)


@triton.jit
def _argmax_kernel(
    # pointers
    x_ptr, out_ptr, host_ptr, part_val_ptr, part_idx_ptr, ticket_ptr,
    # dimensions, strides
    V, stride_x,
    # meta-parameters
    SPLIT: tl.constexpr, BLOCK: tl.constexpr, PART_BLOCKS: tl.constexpr, HOST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    lo = s * (PART_BLOCKS * BLOCK)
    hi = tl.minimum(lo + PART_BLOCKS * BLOCK, V)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32) + lo
    # NOTE: a constexpr trip count: Triton's interpreter cannot range over a runtime int
    for b in range(PART_BLOCKS):
        best, best_i = _take(x_row, lo + b * BLOCK + offs, hi, best, best_i)
    m, idx = _first_max(best, best_i, V)
    tl.store(part_val_ptr + row * SPLIT + s, m)
    tl.store(part_idx_ptr + row * SPLIT + s, idx)
    # NOTE: acq_rel: the parts stored above are visible to the program that draws the last ticket
    ticket = tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel")
    if ticket == SPLIT - 1:
        parts = row * SPLIT + tl.arange(0, SPLIT)
        vals = tl.load(part_val_ptr + parts, cache_modifier=".cg")  # NOTE: from L2, written by other SMs
        idxs = tl.load(part_idx_ptr + parts, cache_modifier=".cg")
        _, first = _first_max(vals, idxs, V)
        tl.store(out_ptr + row, first.to(tl.int64))
        if HOST:  # pinned host memory, mapped: written over the bus, no copy launch behind the kernel
            tl.store(host_ptr + row, first.to(tl.int64))
        tl.store(ticket_ptr + row, 0)


_ARGMAX = FastKernel(_argmax_kernel)


class ArgmaxWorkspace:
    """Every row's parts and its ticket (zero between calls) for up to `rows` rows, on one device."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        self.part_val = torch.empty(rows * MAX_SPLIT, dtype=torch.float32, device=device)
        self.part_idx = torch.empty(rows * MAX_SPLIT, dtype=torch.int32, device=device)
        self.tickets = torch.zeros(rows, dtype=torch.int32, device=device)


def split_for(rows: int, vocab: int, block: int = BLOCK) -> int:
    """Programs a row: a power of two, PROGRAMS in all where the rows allow, 8 to MAX_SPLIT, at
    most one a block of the row."""
    split = min(MAX_SPLIT, max(8, PROGRAMS // max(rows, 1)), cdiv(vocab, block))
    return 1 << (split.bit_length() - 1)


def launch_argmax(logits: Tensor, ws: ArgmaxWorkspace, split: int, block: int = BLOCK, warps: int = 4,
                  host_out: Tensor | None = None) -> Tensor:
    """The argmax of logits [N, V] (N <= ws.rows) over `split` programs a row -> [N] int64; also into
    host_out (argmax.check_host_out) where given."""
    n, v = logits.shape
    if n > ws.rows or not 1 <= split <= MAX_SPLIT or split & (split - 1):
        raise ValueError(f"greedy_argmax: {n} rows, split {split}: the workspace holds {ws.rows} rows and "
                         f"split must be a power of two up to {MAX_SPLIT}")
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    with on_device(logits):
        _ARGMAX[(n, split)](logits, out, out if host_out is None else host_out, ws.part_val, ws.part_idx, ws.tickets,
                            v, logits.stride(0), SPLIT=split, BLOCK=block, PART_BLOCKS=cdiv(cdiv(v, split), block),
                            HOST=host_out is not None, num_warps=warps)
    return out


class GreedyArgmax:
    """Triton `greedy_argmax_ref` (logits [N, V] fp32/bf16/fp16, stride 1 over V -> [N] int64; host_out
    there), with the workspace its programs share, one per device, grown with the rows."""

    __name__ = "greedy_argmax_triton"  # NOTE: what dispatch's Triton kernels are called, as the functions are

    def __init__(self) -> None:
        self._workspaces: dict[torch.device, ArgmaxWorkspace] = {}

    def __call__(self, logits: Tensor, host_out: Tensor | None = None) -> Tensor:
        check_logits(logits)
        check_host_out(logits, host_out)
        n, v = logits.shape
        ws = self._workspaces.get(logits.device)
        if ws is None or ws.rows < n:
            ws = self._workspaces[logits.device] = ArgmaxWorkspace(max(n, 256), logits.device)
        return launch_argmax(logits, ws, split_for(n, v), host_out=host_out)
