"""The SSD scan's launch plan from shapes and config alone (no tensors): which state path, which
chunk the kernels scan in, how many logical chunks the grid must cover, block sizes, and every
launch's grid, scalar arguments and constexprs (`plan_scan`).

ssd_triton.py computes a plan once per input signature (`ScanShape`) and launches by it; every
function here is pure and tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton.language as tl

from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.pdl import launch_options
from pd_ssm.kernels.ssd import NO_DT_LIMIT
from pd_ssm.kernels.ssd_config import SSDConfig

_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# shared memory for the serial state kernel's fetched-ahead tiles (the H200 gives a program 227 KB)
_SERIAL_TILE_BUDGET = 128 * 1024


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


@dataclass(frozen=True, slots=True)
class ScanShape:
    """What a scan's launches depend on, read off its arguments (ssd_triton.py keys plans by it)."""

    T: int
    H: int
    P: int
    G: int
    N: int
    S: int
    chunk_size: int
    dot_dtype: torch.dtype  # the dots' operand dtype: x's where x, B and C share it, else fp32
    elem_size: int  # bytes of an x element
    strides: tuple[int, int, int, int, int, int, int, int]  # x, dt, B, C: (token, head or group) each
    has_D: bool
    has_dt_bias: bool
    dt_softplus: bool
    dt_limit: tuple[float, float]
    boundaries: bool  # return_boundary_states
    max_seqlen: int | None
    tma_readable: bool  # x, B and C readable through TMA descriptors (ssd_triton._tma_readable)
    pdl: bool = False  # the device and Triton launch with PDL (pdl.use_pdl)


class Launch(NamedTuple):
    """One launch: its grid, the runtime scalars after its tensor arguments, its constexprs and options."""

    grid: tuple[int, ...]
    scalars: tuple[int | float, ...]
    constexprs: dict[str, Any]


Tile = tuple[int, int]  # a TMA descriptor's block: rows, columns


@dataclass(frozen=True, slots=True)
class ScanPlan:
    """Sizes of the scratch and the launches of one scan signature, in launch order.

    Either `serial` (chunk states and their passing in one walk) or `state` and `passing` (with
    `dt` before them when dt' has its own launch) run; `cb` where C B^T is made once and loaded.
    """

    Q: int  # the kernels' chunk
    K: int  # logical chunks the grid covers
    dot_dtype: torch.dtype  # of the dots' operands, the passed states and low chunk states
    meta_sizes: tuple[int, int, int, int]  # int32: chunk_info [4 K], seq_first [S], seq_end [S], bcu [S + 1]
    work_sizes: tuple[int, int, int]  # fp32: dt' [H K Q], its cumsum [H K Q], own chunk states [K H P N] or 0
    low_states: int  # chunk end states in the dot dtype, elements (0: none, or fp32 in work)
    starts: int  # the state entering each chunk, in the dot dtype, elements
    cb_shape: tuple[int, int, int, int] | None  # C B^T [K, G, Q, Q] (None: fused into the scan)
    cb_dtype: torch.dtype
    meta: Launch
    serial: Launch | None
    dt: Launch | None
    state: Launch | None
    passing: Launch | None
    cb: Launch | None
    scan: Launch
    state_tiles: tuple[Tile, Tile] | None  # TMA blocks of x and B for the state kernel, either path
    scan_tiles: tuple[Tile, Tile, Tile] | None  # TMA blocks of x, B and C for the scan


def plan_scan(sh: ScanShape, cfg: SSDConfig, interpreted: bool) -> ScanPlan:
    """Every launch of a scan of this signature under `cfg` (ssd_triton.py passes the tensors)."""
    T, H, P, G, N, S, dot_dtype = sh.T, sh.H, sh.P, sh.G, sh.N, sh.S, sh.dot_dtype
    x0, x1, dt0, dt1, B0, B1, C0, C1 = sh.strides
    serial = use_serial_states(cfg, T, S, sh.max_seqlen)
    Q = kernel_chunk(cfg, sh.chunk_size, serial, T, S)  # boundary states stay at chunk_size
    K = max_logical_chunks(T, S, Q)
    PN = P * N
    # NOTE: low chunk states halve the largest round trip (K H P N values written, then read);
    # each is rounded once, before the fp32 sum along the sequence
    low_states = cfg.chunk_states_low and dot_dtype != torch.float32
    own_states = 0 if low_states or serial else K * H * PN  # fp32 chunk end states (two-kernel path)
    meta = Launch((1,), (S, K, Q, S.bit_length(), sh.chunk_size // Q),
                  dict(AT_POSITIONS=sh.boundaries, BLOCK=256, num_warps=4))

    has_limit = sh.dt_limit != NO_DT_LIMIT
    dt_lo, dt_hi = sh.dt_limit if has_limit else (0.0, 0.0)
    dot = dict(DOT_DTYPE=_DOT_DTYPES[dot_dtype], DOT_PRECISION="ieee" if dot_dtype == torch.float32 else "tf32",
               INTERPRETED=interpreted)
    # the chunk-state kernels' (either path's) dimensions and strides
    sizes = (K, H, P, N, H // G, dt_lo, dt_hi, x0, x1, dt0, dt1, B0, B1)
    dt_args = dict(CHUNK=Q, CHUNK_PAD=pow2(Q), HAS_DT_BIAS=sh.has_dt_bias, DT_SOFTPLUS=sh.dt_softplus,
                   HAS_DT_LIMIT=has_limit)
    BP, BN = block(P, 256), block(N, 256)
    # NOTE: the descriptors cost the host time a launch (a short eager scan shows it)
    long_enough = T >= cfg.scan_tma_min_tokens and sh.tma_readable
    serial_launch = dt_launch = state = passing = None
    if serial:
        serial_bn = block(N, cfg.serial_block_n)
        step, serial_bk = serial_step(Q, cfg.serial_block_k)
        # NOTE: TMA boxes reach 256 rows; a serial program's B tile must stay in its group:
        # dstate a whole number of its blocks
        state_tma = cfg.state_tma and long_enough and N % serial_bn == 0 and serial_bk <= 256
        # NOTE: the pipeline holds stages - 1 x and B tiles in shared memory beside the scaled x^T it
        # stages for the dot; whole fp32 chunks (96 KB a stage at P 64) fit two stages, not three
        stage_bytes = serial_bk * (BP + serial_bn) * sh.elem_size
        stages = max(1, min(cfg.serial_stages, 1 + _SERIAL_TILE_BUDGET // stage_bytes))
        state_tiles = ((serial_bk, P), (serial_bk, serial_bn)) if state_tma else None
        serial_launch = Launch(
            (cdiv(N, serial_bn), H, S), (*sizes, sh.chunk_size // Q),
            dict(**dt_args, TMA=state_tma, RETURN_BOUNDARY=sh.boundaries, STEP=step, BLOCK_K=serial_bk,
                 BLOCK_P=BP, BLOCK_N=serial_bn, num_warps=cfg.serial_warps, num_stages=stages, **dot))
    else:
        state_bn = block(N, cfg.state_block_n)
        state_bk = block(Q, cfg.state_block_k)
        # NOTE: a state program's B tile must stay in its group: dstate a whole number of its blocks
        state_tma = cfg.state_tma and long_enough and N % state_bn == 0
        state_tiles = ((state_bk, P), (state_bk, state_bn)) if state_tma else None
        if cfg.state_dt_launch:
            dt_launch = Launch((H, K), (K, dt_lo, dt_hi, dt0, dt1), dict(**dt_args, num_warps=4))
        state = Launch(
            (H, K, cdiv(N, state_bn)), sizes,
            dict(**dt_args, REREAD=cfg.state_reread or cfg.state_dt_launch, TMA=state_tma,
                 DT_DONE=cfg.state_dt_launch, BLOCK_K=state_bk, BLOCK_P=BP, BLOCK_N=state_bn,
                 num_warps=cfg.state_warps, num_stages=cfg.state_stages, **dot))
        pass_block = min(cfg.pass_block, pow2(PN))
    cb_loaded = cfg.scan_cb != "fused"
    block_m = block(Q, cfg.scan_block_m)
    block_k = block(Q, cfg.scan_block_k)
    # NOTE: a scan tile (rows of one row block, columns below (row block + 1) * block_m) lies in one
    # CB block on or below the diagonal, which the CB kernel wrote whole (columns past L as zeros),
    # when CB blocks are whole row blocks, row blocks whole column steps, and chunks whole row blocks
    cb_blk = block(Q, cfg.cb_block) if cb_loaded else 0
    whole_tiles = cb_loaded and cb_blk % block_m == 0 and block_m % block_k == 0 and Q % block_m == 0
    heads = cfg.scan_heads if (H // G) % cfg.scan_heads == 0 else 1
    prefetch = cfg.scan_prefetch and whole_tiles and heads == 1
    # NOTE: the scan's causal part before its PDL gate reads C B^T, cs and dt': none may be the passing
    # kernel's (the launch just before the scan), so dt' has its own launch and C B^T is made before
    # the chunk states (ssd_triton.py's order)
    late_start = cfg.scan_overlap and not serial and cfg.state_dt_launch and prefetch
    overlap = late_start and sh.pdl  # without PDL (CPU, PD_SSM_PDL=0) the same kernel, its gate compiled away
    if not serial:
        passing = Launch((cdiv(PN, pass_block), S, H), (K, H, PN),
                         dict(CHUNK=Q, RETURN_BOUNDARY=sh.boundaries, INTERPRETED=interpreted, BLOCK=pass_block,
                              PDL=overlap, num_warps=cfg.pass_warps, **launch_options(overlap)))

    # fp32 dots (fp32 inputs) keep C B^T in fp32 whatever scan_cb says
    cb_dtype = torch.float32 if cfg.scan_cb == "fp32" else dot_dtype
    cb = None
    if cb_loaded:
        cb = Launch(
            (cdiv(Q, cb_blk), cdiv(Q, cb_blk), K * G), (K, G, N, C0, C1, B0, B1),
            # NOTE: IEEE fp32 dots run on FMA units from registers: narrower dstate steps keep them
            # from spilling (ptxas, sm_90: 255 registers + stack at 128)
            dict(CHUNK=Q, BLOCK=cb_blk, BLOCK_N=block(N, 32 if dot_dtype == torch.float32 else 128),
                 num_warps=cfg.cb_warps, **dot))

    # NOTE: one program's heads must lie in one group; else fall back to one set per program
    loop = cfg.scan_head_loop if (H // G) % (heads * cfg.scan_head_loop) == 0 else 1
    scan_tma = cfg.scan_tma and long_enough
    scan = Launch(
        (H // (heads * loop), cdiv(Q, block_m), K),
        # the output is a fresh contiguous [T, H, P]: strides H P and P
        (K, H, P, N, H // G, G, x0, x1, B0, B1, C0, C1, H * P, P),
        dict(CHUNK=Q, HAS_D=sh.has_D, HEADS=heads, HEAD_LOOP=loop, CB_LOADED=cb_loaded, CB_WHOLE_TILES=whole_tiles,
             TMA=scan_tma, PREFETCH=prefetch, LATE_START=late_start, PDL=overlap, BLOCK_M=block_m,
             BLOCK_K=block_k, BLOCK_P=BP, BLOCK_N=BN, num_warps=cfg.scan_warps, num_stages=cfg.scan_stages,
             maxnreg=cfg.scan_maxnreg, **dot, **launch_options(overlap)))
    return ScanPlan(
        Q=Q, K=K, dot_dtype=dot_dtype, meta_sizes=(4 * K, S, S, S + 1), work_sizes=(H * K * Q, H * K * Q, own_states),
        low_states=K * H * PN if low_states and not serial else 0, starts=K * H * PN,
        cb_shape=(K, G, Q, Q) if cb_loaded else None, cb_dtype=cb_dtype, meta=meta, serial=serial_launch,
        dt=dt_launch, state=state, passing=passing, cb=cb, scan=scan, state_tiles=state_tiles,
        scan_tiles=((block_k, P), (block_k, N), (block_m, N)) if scan_tma else None,
    )
