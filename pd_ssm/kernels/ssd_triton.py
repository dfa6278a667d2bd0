"""Triton launcher of the Mamba2 SSD chunked scan over a varlen batch.

Same contract as `ssd.mamba_chunk_scan_varlen_ref` (signature, semantics, ScanOutput); the kernels
are in `ssd_triton_kernels.py`, `ssd_triton_serial.py`, `ssd_triton_bmm.py` and `ssd_triton_scan.py`;
their block shapes and switches in `ssd_config.py`; every launch's grid, scalars and constexprs,
from shapes and config alone, in `ssd_plan.py` (a plan is made once per input signature).
Four launches: chunk metadata, chunk states (dt' and its cumsum fused in), state passing along each
sequence, chunk scan (the C B^T product fused in). For batches of short sequences (bf16 / fp16:
at most SSDConfig.serial_max_tokens, `use_serial_states`) the middle two are one launch that walks
each sequence, in chunks of SSDConfig.serial_chunk (`kernel_chunk`); with SSDConfig.scan_cb !=
"fused", one more launch makes C B^T once per (chunk, group) and the scan loads it. Launch order:
metadata, dt' (where it has its own launch), C B^T, the states, the scan: the scan may then read
everything but the entering states before its PDL gate (SSDConfig.scan_overlap).

No host synchronization unless return_boundary_states is set: the logical-chunk grid is sized by
an upper bound computed from shapes alone, and programs past the real count exit at once. The
number of boundary states sizes an output, so asking for them costs one read of a device scalar.
cu_seqlens and context_lens are therefore not validated here (the reference does, on the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from pd_ssm.kernels.launch import Compiled, FastKernel
from pd_ssm.kernels.pdl import use_pdl
from pd_ssm.kernels.ssd import NO_DT_LIMIT, ScanOutput, _check_scan_args
from pd_ssm.kernels.ssd_config import SSDConfig, default_config
from pd_ssm.kernels.ssd_plan import Launch, ScanPlan, ScanShape, block, plan_scan
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
# NOTE: an eager call's host time (its launches and their arguments) exceeds its device time up to
# ~8192 tokens: the kernels launch through FastKernel's cache of compiled kernels (launch.py), by
# plans kept per input signature (below)
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
    # NOTE: built without TensorDescriptor's __post_init__ checks (~4 us of host time each): the plan
    # uses descriptors only for a signature `_tma_readable` passed (alignments, strides, tile widths)
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides = t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1]
    d.block_shape, d.padding = [rows, cols], "zero"
    return d


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


class _Prepared:
    """A scan signature's plan and, per launch, the compiled kernel FastKernel returned for it."""

    __slots__ = ("plan", "compiled")

    def __init__(self, plan: ScanPlan) -> None:
        self.plan = plan
        self.compiled: list[Compiled | None] = [None] * 7

    def go(self, i: int, kernel: FastKernel, launch: Launch, tensors: tuple[Any, ...]) -> None:
        self.compiled[i] = kernel.run(launch.grid, (*tensors, *launch.scalars), launch.constexprs, self.compiled[i])


# NOTE: plans by input signature; bounded (prefill batches of every token count each have one), and
# cleared whole when full: a plan costs ~0.1 ms of host time to make again
_PLANS: dict[tuple[Any, ...], _Prepared] = {}
_MAX_PLANS = 512


def _signature(t: Tensor | None) -> tuple[Any, ...] | None:
    # everything of a tensor that the checks, the plan or Triton's specialization look at
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def ssd_scan_with_config(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, *, cu_seqlens: Tensor,
    context_lens: Tensor, ssm_state: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    D: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool, dt_limit: Sequence[float],
    return_boundary_states: bool, config: SSDConfig | None, max_seqlen: int | None = None,
) -> ScanOutput:
    """`mamba_chunk_scan_varlen_triton` with explicit block shapes (None: the default for the dtype).

    A call whose arguments match an earlier call's signature (`_signature` of every tensor, the
    scalars, the config) reuses that call's checks, plan and compiled kernels: its host time is the
    allocations and the launches (an eager scan's host time exceeds its device time up to ~8192
    tokens, benchmarks/RESULTS.md, session 17).
    """
    limit = (float(dt_limit[0]), float(dt_limit[1]))
    key = (*map(_signature, (x, dt, A, B, C, cu_seqlens, context_lens, ssm_state, state_indices, has_initial_state,
                            D, dt_bias)),
           chunk_size, dt_softplus, limit, return_boundary_states, config, max_seqlen)
    prepared = _PLANS.get(key)
    if prepared is None:
        _check_scan_args(x, dt, A, B, C, chunk_size, cu_seqlens, context_lens, ssm_state, state_indices,
                         has_initial_state, D, dt_bias)
        T, H, P = x.shape
        G, N = B.shape[1], B.shape[2]
        S = cu_seqlens.shape[0] - 1
        if P > 256 or N > 256:
            raise ValueError(f"mamba_chunk_scan_varlen_triton: headdim ({P}) and dstate ({N}) must be <= 256")
        if T == 0:
            out = torch.empty((0, H, P), dtype=x.dtype, device=x.device)
            if not return_boundary_states:
                return ScanOutput(out, None, None)
            bcu = torch.zeros(S + 1, dtype=torch.int32, device=x.device)
            return ScanOutput(out, torch.zeros(0, H, P, N, dtype=torch.float32, device=x.device), bcu)
        dot_dtype = x.dtype if x.dtype == B.dtype == C.dtype else torch.float32
        shape = ScanShape(
            T=T, H=H, P=P, G=G, N=N, S=S, chunk_size=chunk_size, dot_dtype=dot_dtype, elem_size=x.element_size(),
            strides=(x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0),
                     C.stride(1)),
            has_D=D is not None, has_dt_bias=dt_bias is not None, dt_softplus=dt_softplus, dt_limit=limit,
            boundaries=return_boundary_states, max_seqlen=max_seqlen,
            tma_readable=_tma_readable(x, B, C, block(P, 256), block(N, 256)), pdl=use_pdl(x))
        prepared = _Prepared(plan_scan(shape, config or default_config(dot_dtype, T), _INTERPRETED))
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = prepared
    return _scan(prepared, x, dt, A, B, C, cu_seqlens, context_lens, ssm_state, state_indices, has_initial_state,
                 D, dt_bias, return_boundary_states)


def _scan(
    prepared: _Prepared, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, cu_seqlens: Tensor,
    context_lens: Tensor, ssm_state: Tensor, state_indices: Tensor, has_initial_state: Tensor, D: Tensor | None,
    dt_bias: Tensor | None, boundaries: bool,
) -> ScanOutput:
    """The launches of a checked call by its plan."""
    p = prepared.plan
    T, H, P = x.shape
    N = B.shape[2]
    dev = x.device
    out = torch.empty((T, H, P), dtype=x.dtype, device=dev)  # [T, H, P]
    # scratch: one int32 and one fp32 allocation, carved into views
    chunk_info, seq_first, seq_end, bcu = _carve(torch.empty(sum(p.meta_sizes), dtype=torch.int32, device=dev),
                                                 p.meta_sizes)
    dt_buf, cs_buf, states = _carve(torch.empty(sum(p.work_sizes), dtype=torch.float32, device=dev), p.work_sizes)
    if p.low_states:
        states = torch.empty(p.low_states, dtype=p.dot_dtype, device=dev)  # each chunk's own end state
    starts = torch.empty(p.starts, dtype=p.dot_dtype, device=dev)  # the state entering each chunk

    prepared.go(0, _META, p.meta, (cu_seqlens, context_lens, chunk_info, seq_first, seq_end, bcu))
    if p.dt is not None:
        prepared.go(2, _DT, p.dt, (dt, A, dt_bias, chunk_info, dt_buf, cs_buf))
    cb = out  # never read where CB_LOADED is off
    if p.cb is not None and p.cb_shape is not None:
        # NOTE: before the states: the scan may read C B^T before its PDL gate only where the launch just
        # before it is not the one that made it (ssd_plan.py, scan_overlap)
        cb = torch.empty(p.cb_shape, dtype=p.cb_dtype, device=dev)  # [K, G, Q, Q], s <= l < L written
        prepared.go(5, _CB, p.cb, (C, B, chunk_info, cb))

    def boundary_out() -> Tensor:
        if not boundaries:
            return starts  # never written: RETURN_BOUNDARY is off
        # NOTE: the one host synchronization: the count of boundary states sizes the output
        return torch.empty((int(bcu[-1]), H, P, N), dtype=torch.float32, device=dev)

    sx, sB = (x, B) if p.state_tiles is None else (_descriptor(x, *p.state_tiles[0]), _descriptor(B, *p.state_tiles[1]))
    if p.serial is not None:
        bstates = boundary_out()
        prepared.go(1, _SERIAL, p.serial, (
            x, dt, A, dt_bias, B, cu_seqlens, context_lens, seq_first, bcu, state_indices, has_initial_state,
            dt_buf, cs_buf, starts, ssm_state, bstates, sx, sB))
    else:
        assert p.state is not None and p.passing is not None
        prepared.go(3, _STATE, p.state, (x, dt, A, dt_bias, B, chunk_info, dt_buf, cs_buf, states, sx, sB))
        bstates = boundary_out()  # NOTE: after the chunk-state launch, which runs while the host waits
        prepared.go(4, _PASSING, p.passing, (
            states, cs_buf, chunk_info, seq_first, seq_end, state_indices, has_initial_state, starts, ssm_state,
            bstates))

    xd, Bd, Cd = (x, B, C) if p.scan_tiles is None else (
        _descriptor(x, *p.scan_tiles[0]), _descriptor(B, *p.scan_tiles[1]), _descriptor(C, *p.scan_tiles[2]))
    prepared.go(6, _SCAN, p.scan, (x, B, C, D, dt_buf, cs_buf, starts, chunk_info, cb, out, xd, Bd, Cd))
    if not boundaries:
        return ScanOutput(out, None, None)
    return ScanOutput(out, bstates, bcu)


def _carve(buf: Tensor, sizes: Sequence[int]) -> list[Tensor]:
    """Consecutive views of `buf`, of these sizes (slices: Tensor.split costs the host more)."""
    views, at = [], 0
    for n in sizes:
        views.append(buf[at:at + n])
        at += n
    return views
