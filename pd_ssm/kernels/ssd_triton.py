"""Triton launcher of the Mamba2 SSD chunked scan over a varlen batch.

Same contract as `ssd.mamba_chunk_scan_varlen_ref` (signature, semantics, ScanOutput); the kernels
are in `ssd_triton_kernels.py`, `ssd_triton_serial.py`, `ssd_triton_bmm.py` and `ssd_triton_scan.py`;
their block shapes and switches in `ssd_config.py`; the choices made from shapes alone (state path,
kernel chunk, grid bound, blocks) in `ssd_plan.py`.
Four launches: chunk metadata, chunk states (dt' and its cumsum fused in), state passing along each
sequence, chunk scan (the C B^T product fused in). For batches of short sequences (bf16 / fp16:
at most SSDConfig.serial_max_tokens, `use_serial_states`) the middle two are one launch that walks
each sequence, in chunks of SSDConfig.serial_chunk (`kernel_chunk`); with SSDConfig.scan_cb !=
"fused", one more launch makes C B^T once per (chunk, group) and the scan loads it.

No host synchronization unless return_boundary_states is set: the logical-chunk grid is sized by
an upper bound computed from shapes alone, and programs past the real count exit at once. The
number of boundary states sizes an output, so asking for them costs one read of a device scalar.
cu_seqlens and context_lens are therefore not validated here (the reference does, on the host).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from pd_ssm.kernels.launch import FastKernel
from pd_ssm.kernels.ssd import NO_DT_LIMIT, ScanOutput, _check_scan_args
from pd_ssm.kernels.ssd_config import SSDConfig, default_config
from pd_ssm.kernels.ssd_plan import (
    block,
    cdiv,
    kernel_chunk,
    max_logical_chunks,
    pow2,
    serial_step,
    use_serial_states,
)
from pd_ssm.kernels.ssd_triton_bmm import _ssd_chunk_cb_kernel
from pd_ssm.kernels.ssd_triton_kernels import (
    _ssd_chunk_dt_kernel,
    _ssd_chunk_meta_kernel,
    _ssd_chunk_state_kernel,
    _ssd_state_passing_kernel,
)
from pd_ssm.kernels.ssd_triton_scan import _ssd_chunk_scan_kernel
from pd_ssm.kernels.ssd_triton_serial import _ssd_state_serial_kernel

# the interpreter replaces @triton.jit functions at import when TRITON_INTERPRET=1
_INTERPRETED = isinstance(_ssd_chunk_scan_kernel, InterpretedFunction)
# shared memory for the serial state kernel's fetched-ahead tiles (the H200 gives a program 227 KB)
_SERIAL_TILE_BUDGET = 128 * 1024
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# NOTE: an eager call's host time (its launches and their arguments) exceeds its device time up to
# ~8192 tokens: the kernels launch through FastKernel's cache of compiled kernels (launch.py)
_META, _SERIAL, _DT, _STATE, _PASSING, _CB, _SCAN = map(FastKernel, (
    _ssd_chunk_meta_kernel, _ssd_state_serial_kernel, _ssd_chunk_dt_kernel, _ssd_chunk_state_kernel,
    _ssd_state_passing_kernel, _ssd_chunk_cb_kernel, _ssd_chunk_scan_kernel))


def _tma_readable(x: Tensor, B: Tensor, C: Tensor, block_p: int, block_n: int) -> bool:
    """Whether TMA descriptors can read x as [T, H * P] and B, C as [T, G * N]: a head's or a
    group's tile must be exactly P or N wide (a wider one would read the next head or group), and
    TMA needs 16-byte aligned bases and row strides, unit inner strides."""
    P, N = x.shape[2], B.shape[2]
    if (P, N) != (block_p, block_n):
        return False
    return all(t.stride(2) == 1 and t.stride(1) == inner and t.data_ptr() % 16 == 0
               and (t.stride(0) * t.element_size()) % 16 == 0 for t, inner in ((x, P), (B, N), (C, N)))


def _descriptor(t: Tensor, rows: int, cols: int) -> TensorDescriptor:
    """A TMA descriptor of `t` [T, H, P] (or [T, G, N]) as [T, H * P], tiles of [rows, cols]."""
    return TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [rows, cols])


def mamba_chunk_scan_varlen_triton(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    *,
    cu_seqlens: Tensor,
    context_lens: Tensor,
    ssm_state: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: Sequence[float] = NO_DT_LIMIT,
    return_boundary_states: bool = False,
    max_seqlen: int | None = None,
) -> ScanOutput:
    """Chunked SSD scan of S sequences laid end to end (T tokens), each from its own state.

    Shapes and semantics are those of `ssd.mamba_chunk_scan_varlen_ref`:
      x [T, H, P], dt [T, H] raw, A [H] fp32, B / C [T, G, N], cu_seqlens [S+1] int32,
      context_lens [S] int32 (absolute position of each sequence's first token), ssm_state
      [num_slots, H, P, N] pool (read where has_initial_state, final state written in place into
      ssm_state[state_indices[s]]), D / dt_bias [H] or None.
    Returns ScanOutput(out [T, H, P] in x.dtype, boundary_states [num_boundaries, H, P, N] fp32 or
    None, boundary_cu [S+1] int32 or None).

    fp32 inputs use IEEE fp32 dots; bf16 / fp16 inputs (x, B and C of one dtype) use dots in that
    dtype with fp32 accumulation, and carry the passed states in it too. All else is fp32.
    """
    return ssd_scan_with_config(
        x, dt, A, B, C, chunk_size, cu_seqlens=cu_seqlens, context_lens=context_lens,
        ssm_state=ssm_state, state_indices=state_indices, has_initial_state=has_initial_state, D=D,
        dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
        return_boundary_states=return_boundary_states, config=None, max_seqlen=max_seqlen,
    )


def ssd_scan_with_config(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, *, cu_seqlens: Tensor,
    context_lens: Tensor, ssm_state: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    D: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool, dt_limit: Sequence[float],
    return_boundary_states: bool, config: SSDConfig | None, max_seqlen: int | None = None,
) -> ScanOutput:
    """`mamba_chunk_scan_varlen_triton` with explicit block shapes (None: the default for the dtype)."""
    _check_scan_args(x, dt, A, B, C, chunk_size, cu_seqlens, context_lens, ssm_state, state_indices,
                     has_initial_state, D, dt_bias)
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    S = cu_seqlens.shape[0] - 1
    if P > 256 or N > 256:
        raise ValueError(f"mamba_chunk_scan_varlen_triton: headdim ({P}) and dstate ({N}) must be <= 256")
    dev = x.device
    out = torch.empty((T, H, P), dtype=x.dtype, device=dev)  # [T, H, P]
    if T == 0:
        empty = torch.zeros(0, H, P, N, dtype=torch.float32, device=dev)
        bcu = torch.zeros(S + 1, dtype=torch.int32, device=dev)
        return ScanOutput(out, empty, bcu) if return_boundary_states else ScanOutput(out, None, None)

    same = x.dtype == B.dtype == C.dtype
    dot_dtype = x.dtype if same else torch.float32
    cfg = config or default_config(dot_dtype, T)
    serial = use_serial_states(cfg, T, S, max_seqlen)
    Q = kernel_chunk(cfg, chunk_size, serial, T, S)  # the kernels' chunk; boundary states stay at chunk_size
    K = max_logical_chunks(T, S, Q)
    PN = P * N

    # scratch: one int32 and one fp32 allocation, carved into views
    meta = torch.empty(4 * K + 3 * S + 1, dtype=torch.int32, device=dev)
    chunk_info, seq_first, seq_end, bcu = meta.split([4 * K, S, S, S + 1])
    # NOTE: low chunk states halve the largest round trip (K H P N values written, then read);
    # each is rounded once, before the fp32 sum along the sequence
    low_states = cfg.chunk_states_low and dot_dtype != torch.float32
    own_states = 0 if low_states or serial else K * H * PN  # fp32 chunk end states (two-kernel path)
    work = torch.empty(2 * H * K * Q + own_states, dtype=torch.float32, device=dev)
    dt_buf, cs_buf, states = work.split([H * K * Q, H * K * Q, own_states])
    if low_states and not serial:
        states = torch.empty(K * H * PN, dtype=dot_dtype, device=dev)  # each chunk's own end state
    starts = torch.empty(K * H * PN, dtype=dot_dtype, device=dev)  # the state entering each chunk

    _META[(1,)](
        cu_seqlens, context_lens, chunk_info, seq_first, seq_end, bcu,
        S, K, Q, S.bit_length(), chunk_size // Q, AT_POSITIONS=return_boundary_states, BLOCK=256, num_warps=4,
    )

    def boundary_out() -> Tensor:
        if not return_boundary_states:
            return starts  # never written: RETURN_BOUNDARY is off
        # NOTE: the one host synchronization: the count of boundary states sizes the output
        return torch.empty((int(bcu[S]), H, P, N), dtype=torch.float32, device=dev)

    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    has_limit = (lo, hi) != NO_DT_LIMIT
    dot = dict(DOT_DTYPE=_DOT_DTYPES[dot_dtype], DOT_PRECISION="ieee" if dot_dtype == torch.float32 else "tf32",
               INTERPRETED=_INTERPRETED)
    # the chunk-state kernels' (either path's) dimensions and strides, and their dt' switches
    dt_lo, dt_hi = (lo, hi) if has_limit else (0.0, 0.0)
    sizes = (K, H, P, N, H // G, dt_lo, dt_hi, x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0),
             B.stride(1))
    dt_args = dict(CHUNK=Q, CHUNK_PAD=pow2(Q), HAS_DT_BIAS=dt_bias is not None,
                   DT_SOFTPLUS=dt_softplus, HAS_DT_LIMIT=has_limit)
    BP, BN = block(P, 256), block(N, 256)
    # NOTE: the descriptors cost the host ~40 us a launch (a short eager scan shows it)
    long_enough = T >= cfg.scan_tma_min_tokens and _tma_readable(x, B, C, BP, BN)
    if serial:
        serial_bn = block(N, cfg.serial_block_n)
        step, serial_bk = serial_step(Q, cfg.serial_block_k)
        # NOTE: TMA boxes reach 256 rows; a serial program's B tile must stay in its group:
        # dstate a whole number of its blocks
        serial_tma = cfg.state_tma and long_enough and N % serial_bn == 0 and serial_bk <= 256
        # NOTE: the pipeline holds stages - 1 x and B tiles in shared memory beside the scaled x^T it
        # stages for the dot; whole fp32 chunks (96 KB a stage at P 64) fit two stages, not three
        stage_bytes = serial_bk * (BP + serial_bn) * x.element_size()
        serial_stages = max(1, min(cfg.serial_stages, 1 + _SERIAL_TILE_BUDGET // stage_bytes))
        sx_desc, sB_desc = ((_descriptor(x, serial_bk, P), _descriptor(B, serial_bk, serial_bn)) if serial_tma
                            else (x, B))
        bstates = boundary_out()
        _SERIAL[(H, S, cdiv(N, serial_bn))](
            x, dt, A, dt_bias, B, cu_seqlens, context_lens, seq_first, bcu, state_indices, has_initial_state,
            dt_buf, cs_buf, starts, ssm_state, bstates, sx_desc, sB_desc,
            *sizes, chunk_size // Q,
            **dt_args, TMA=serial_tma, RETURN_BOUNDARY=return_boundary_states, STEP=step, BLOCK_K=serial_bk,
            BLOCK_P=BP, BLOCK_N=serial_bn, num_warps=cfg.serial_warps, num_stages=serial_stages, **dot,
        )
    else:
        state_bn = block(N, cfg.state_block_n)
        state_bk = block(Q, cfg.state_block_k)
        # NOTE: a state program's B tile must stay in its group: dstate a whole number of its blocks
        state_tma = cfg.state_tma and long_enough and N % state_bn == 0
        sx_desc, sB_desc = ((_descriptor(x, state_bk, P), _descriptor(B, state_bk, state_bn)) if state_tma
                            else (x, B))
        if cfg.state_dt_launch:
            _DT[(H, K)](
                dt, A, dt_bias, chunk_info, dt_buf, cs_buf, K, dt_lo, dt_hi, dt.stride(0), dt.stride(1),
                **dt_args, num_warps=4,
            )
        _STATE[(H, K, cdiv(N, state_bn))](
            x, dt, A, dt_bias, B, chunk_info, dt_buf, cs_buf, states, sx_desc, sB_desc,
            *sizes,
            **dt_args, REREAD=cfg.state_reread or cfg.state_dt_launch, TMA=state_tma, DT_DONE=cfg.state_dt_launch,
            BLOCK_K=state_bk, BLOCK_P=BP, BLOCK_N=state_bn, num_warps=cfg.state_warps, num_stages=cfg.state_stages,
            **dot,
        )
        bstates = boundary_out()  # NOTE: after the chunk-state launch, which runs while the host waits
        pass_block = min(cfg.pass_block, pow2(PN))
        _PASSING[(cdiv(PN, pass_block), S, H)](
            states, cs_buf, chunk_info, seq_first, seq_end, state_indices, has_initial_state,
            starts, ssm_state, bstates, K, H, PN,
            CHUNK=Q, RETURN_BOUNDARY=return_boundary_states, INTERPRETED=_INTERPRETED, BLOCK=pass_block,
            num_warps=cfg.pass_warps,
        )

    cb_loaded = cfg.scan_cb != "fused"
    if cb_loaded:
        # fp32 dots (fp32 inputs) keep C B^T in fp32 whatever scan_cb says
        cb_dtype = torch.float32 if cfg.scan_cb == "fp32" else dot_dtype
        cb = torch.empty((K, G, Q, Q), dtype=cb_dtype, device=dev)  # [K, G, Q, Q], s <= l < L written
        cb_blk = block(Q, cfg.cb_block)
        _CB[(cdiv(Q, cb_blk), cdiv(Q, cb_blk), K * G)](
            C, B, chunk_info, cb, K, G, N, C.stride(0), C.stride(1), B.stride(0), B.stride(1),
            # NOTE: IEEE fp32 dots run on FMA units from registers: narrower dstate steps keep them
            # from spilling (ptxas, sm_90: 255 registers + stack at 128)
            CHUNK=Q, BLOCK=cb_blk, BLOCK_N=block(N, 32 if dot_dtype == torch.float32 else 128),
            num_warps=cfg.cb_warps, **dot,
        )
    else:
        cb, cb_blk = out, 0  # never read: CB_LOADED is off

    block_m = block(Q, cfg.scan_block_m)
    block_k = block(Q, cfg.scan_block_k)
    # NOTE: a scan tile (rows of one row block, columns below (row block + 1) * block_m) lies in one
    # CB block on or below the diagonal, which the CB kernel wrote whole (columns past L as zeros),
    # when CB blocks are whole row blocks, row blocks whole column steps, and chunks whole row blocks
    whole_tiles = cb_loaded and cb_blk % block_m == 0 and block_m % block_k == 0 and Q % block_m == 0
    heads = cfg.scan_heads if (H // G) % cfg.scan_heads == 0 else 1
    # NOTE: one program's heads must lie in one group; else fall back to one set per program
    loop = cfg.scan_head_loop if (H // G) % (heads * cfg.scan_head_loop) == 0 else 1
    scan_tma = cfg.scan_tma and long_enough
    prefetch = cfg.scan_prefetch and whole_tiles and heads == 1
    x_desc, B_desc, C_desc = ((_descriptor(x, block_k, P), _descriptor(B, block_k, N), _descriptor(C, block_m, N))
                              if scan_tma else (x, B, C))  # unused without TMA
    _SCAN[(H // (heads * loop), cdiv(Q, block_m), K)](
        x, B, C, D, dt_buf, cs_buf, starts, chunk_info, cb, out, x_desc, B_desc, C_desc,
        K, H, P, N, H // G, G,
        x.stride(0), x.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        out.stride(0), out.stride(1),
        CHUNK=Q, HAS_D=D is not None, HEADS=heads, HEAD_LOOP=loop, CB_LOADED=cb_loaded, CB_WHOLE_TILES=whole_tiles, TMA=scan_tma,
        PREFETCH=prefetch, BLOCK_M=block_m, BLOCK_K=block_k,
        BLOCK_P=BP, BLOCK_N=BN, num_warps=cfg.scan_warps, num_stages=cfg.scan_stages, maxnreg=cfg.scan_maxnreg, **dot,
    )
    if not return_boundary_states:
        return ScanOutput(out, None, None)
    return ScanOutput(out, bstates, bcu)
