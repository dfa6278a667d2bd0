"""Triton `mixer_stack_step_ref`: the decode step of a run of Mamba2 blocks at one row, one launch.

At batch 1 a block's decode step is three weight streams and a small kernel between them: in_proj
with the conv (in_proj_conv_triton.py), the state update and the gate (mixer_decode_triton.py),
out_proj with the residual add and the next norm left pending (out_proj_add_triton.py). Each launch
boundary drains the memory pipe: the last programs of one launch finish, the next launch's programs
start, and their first loads take a DRAM latency to return. Three plain streaming kernels a layer
ran at 25.8-29.9 us a layer where the same bytes in one launch stream at 4.45-4.5 TB/s, 19.2 us
(benchmarks/handoff_gpu.py, H200, RESULTS.md session 22).

Here one launch runs every block of the run, each in three phases, its grid sized so that every
program is resident at once; phases are separated by grid barriers (an atomic count: `grid_arrive`
releases a program's stores, `grid_wait` acquires everyone's). Between arriving and waiting a
program issues the loads the next phase needs that do not depend on the barrier: the state-update
tile's state and the out_proj tile's first weight columns before the first barrier of a block, the
next block's in_proj tile's conv taps and first weight columns before its last. (Issued before
arriving they would delay it: a release waits for the program's loads in flight.) Tiles are the
three kernels' own, through the same jit functions, so the arithmetic (and every bit) is theirs.

Phase by phase, program p takes tiles p, p + G, ... (G programs):
  1. in_proj columns over the pending norm, with the conv of its xBC columns
  2. the gated state update of a [BLOCK_P, dstate] tile of one head
  3. out_proj columns over g, the residual add, the next norm's x and partial squares
Per-block tensors are layer 0's pointers plus a table of element offsets (`offsets`); the pending
norm and residual between blocks go through two ping-pong buffers. The counts go back to zero at the
end (the last program to leave resets them), so calls chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from pd_ssm.kernels._device import num_sms, on_device
from pd_ssm.kernels._grid import cdiv, pow2
from pd_ssm.kernels.in_proj_conv_triton import in_proj_tile_post, in_proj_tile_pre
from pd_ssm.kernels.mixer_decode_triton import gated_ssu_post, gated_ssu_pre
from pd_ssm.kernels.out_proj_add_triton import out_proj_tile_post, out_proj_tile_pre
from pd_ssm.kernels.pdl import launch_options, pdl_gate, use_pdl
from pd_ssm.kernels.pending_norm import PendingNorm
from pd_ssm.kernels.skinny_linear_triton import LinearTile

# NOTE: ~2^24 polls (seconds): a grid that was not resident at once would hang here; it sets the
# error word instead and runs on, so a test sees it (`MixerStepWorkspace.check`)
SPIN_LIMIT = tl.constexpr(1 << 24)
# the offsets table's columns (elements from layer 0's tensor of each kind)
O_W_IN, O_B_IN, O_CONV, O_CW, O_CB, O_SSM, O_A, O_D, O_DTB, O_GW, O_W_OUT, O_NW = (tl.constexpr(i) for i in range(12))
NOFF = tl.constexpr(12)


@triton.jit
def grid_arrive(sync_ptr):
    """Count this program in at the barrier; its stores before are visible to whoever waits."""
    tl.debug_barrier()  # every thread's stores before the release
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")


@triton.jit
def grid_wait(sync_ptr, target):
    """Wait until `target` arrivals have been counted; every program's stores before them are visible
    to this program's loads after."""
    c = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (c < target) & (spins < SPIN_LIMIT):
        c = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if spins >= SPIN_LIMIT:
        tl.store(sync_ptr + 2, 1)
    tl.debug_barrier()  # thread 0's acquire before any thread's loads


@triton.jit
def _stamp(stamps_ptr, blk, pid, G, i: tl.constexpr, TIMELINE: tl.constexpr):
    """TIMELINE (benchmarks only): the GPU's global timer (ns) at point i of program pid in block blk,
    into stamps [L, G, 8]."""
    if TIMELINE:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False,
                                        pack=1)
        tl.store(stamps_ptr + (blk * G + pid) * 8 + i, now)


@triton.jit
def _layer_off(off_ptr, blk, col: tl.constexpr):
    return tl.load(off_ptr + blk * NOFF + col)


@triton.jit
def _mixer_stack_kernel(
    # per-block tensors: layer 0's (offsets: [L, NOFF] elements from them, a row a block)
    w_in_ptr, b_in_ptr, conv_ptr, cw_ptr, cb_ptr, ssm_ptr, A_ptr, D_ptr, dt_bias_ptr, gnorm_w_ptr, w_out_ptr, nw_ptr,
    off_ptr,
    # the run's input (a pending norm and the residual) and output, the ping-pong buffers between blocks
    x_in_ptr, ss_in_ptr, res_in_ptr, x_out_ptr, ss_out_ptr, res_out_ptr, x_buf_ptr, ss_buf_ptr, res_buf_ptr,
    # one block's intermediates (in_proj's output, the conv's, g and its squares) and the slot
    proj_ptr, xbc_ptr, g_ptr, sq_ptr, slot_ptr,
    # the grid's counts: [arrivals, departures, error]; TIMELINE's stamps
    sync_ptr, stamps_ptr,
    # dimensions (the K's are specialized on: a layer's never change)
    N_in, K_in: tl.constexpr, d_inner: tl.constexpr, conv_dim, n_ss_in, eps_in, headdim, dstate, heads_per_group,
    n_heads, gn, gated_eps, norm_eps,
    # strides (the last axes have stride 1; the pools are contiguous)
    stride_w_in, stride_cw_d, stride_cw_k, stride_ssm_slot, stride_ssm_head, stride_w_out,
    # meta-parameters
    L: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, WIDTH: tl.constexpr,
    FAST_EXP: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    BN1: tl.constexpr, BK1: tl.constexpr, ST1: tl.constexpr, PRE1: tl.constexpr, PER1: tl.constexpr,
    SS_BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, P_TILES: tl.constexpr, PER2: tl.constexpr,
    BN3: tl.constexpr, BK3: tl.constexpr, ST3: tl.constexpr, PRE3: tl.constexpr, PER3: tl.constexpr,
    SQ_BLOCK: tl.constexpr, PDL: tl.constexpr, TIMELINE: tl.constexpr,
):
    """PER1 / PER2 / PER3: tiles a program in each phase, at most (static trip counts)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    N_out = K_in
    T1 = tl.cdiv(N_in, BN1)
    T2 = n_heads * P_TILES
    T3 = tl.cdiv(N_out, BN3)
    slot = tl.load(slot_ptr).to(tl.int64)
    act = proj_ptr.dtype.element_ty
    offs_s = tl.arange(0, SS_BLOCK)
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N] dstate column
    n_ok = offs_n < dstate
    offs_q = tl.arange(0, SQ_BLOCK)
    # before the PDL gate: block 0's first in_proj tile's conv taps and weights (no launch of this step
    # writes them); x, its squares and the residual are the launch before's
    pre1 = in_proj_tile_pre(w_in_ptr, conv_ptr, slot, cw_ptr, cb_ptr, pid * BN1, N_in, K_in, d_inner, conv_dim,
                            stride_w_in, stride_cw_d, stride_cw_k, act, HAS_CONV_BIAS, WIDTH, BN1, PRE1)
    _stamp(stamps_ptr, 0, pid, G, 0, TIMELINE)
    pdl_gate(PDL)
    for blk in range(L):
        _stamp(stamps_ptr, blk, pid, G, 1, TIMELINE)
        w_in_l = w_in_ptr + _layer_off(off_ptr, blk, O_W_IN)
        b_in_l = b_in_ptr + _layer_off(off_ptr, blk, O_B_IN) if HAS_BIAS else b_in_ptr
        conv_l = conv_ptr + _layer_off(off_ptr, blk, O_CONV)
        cw_l = cw_ptr + _layer_off(off_ptr, blk, O_CW)
        cb_l = cb_ptr + _layer_off(off_ptr, blk, O_CB) if HAS_CONV_BIAS else cb_ptr
        # the pending norm into this block: the run's input, or the buffer the block before wrote
        if blk == 0:
            x_l = x_in_ptr
            ss_l = ss_in_ptr
            res_l = res_in_ptr
        else:
            x_l = x_buf_ptr + ((blk - 1) % 2) * N_out
            ss_l = ss_buf_ptr + ((blk - 1) % 2) * T3
            res_l = res_buf_ptr + ((blk - 1) % 2) * N_out
        n_ss = tl.where(blk == 0, n_ss_in, T3)
        ss = tl.load(ss_l + offs_s, mask=offs_s < n_ss, other=0.0)

        # phase 1: in_proj + conv
        for i in tl.static_range(PER1):
            t = pid + i * G
            if i > 0:
                pre1 = in_proj_tile_pre(w_in_l, conv_l, slot, cw_l, cb_l, t * BN1, N_in, K_in, d_inner, conv_dim,
                                        stride_w_in, stride_cw_d, stride_cw_k, act, HAS_CONV_BIAS, WIDTH, BN1, PRE1)
            if t < T1:
                in_proj_tile_post(pre1, x_l, b_in_l, proj_ptr, conv_l, slot, xbc_ptr, ss, t * BN1, N_in, K_in,
                                  d_inner, conv_dim, tl.where(blk == 0, eps_in, norm_eps), HAS_BIAS, HAS_CONV_BIAS,
                                  WIDTH, FAST_EXP, BN1, BK1, ST1, PRE1, True)
        _stamp(stamps_ptr, blk, pid, G, 2, TIMELINE)
        grid_arrive(sync_ptr)
        # while the slowest in_proj tiles finish: this block's first state-update tile's state and
        # first out_proj tile's weights and residual
        ssm_l = ssm_ptr + _layer_off(off_ptr, blk, O_SSM)
        A_l = A_ptr + _layer_off(off_ptr, blk, O_A)
        D_l = D_ptr + _layer_off(off_ptr, blk, O_D) if HAS_D else D_ptr
        dtb_l = dt_bias_ptr + _layer_off(off_ptr, blk, O_DTB) if HAS_DT_BIAS else dt_bias_ptr
        gw_l = gnorm_w_ptr + _layer_off(off_ptr, blk, O_GW)
        w_out_l = w_out_ptr + _layer_off(off_ptr, blk, O_W_OUT)
        nw_l = nw_ptr + _layer_off(off_ptr, blk, O_NW)
        s = pid
        h = tl.minimum(s // P_TILES, n_heads - 1)
        offs_p = (s % P_TILES) * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P] headdim row
        p_ok = (offs_p < headdim) & (s < T2)
        c_x = h * headdim + offs_p  # [BLOCK_P] channel in z, in x and in g
        ssu = gated_ssu_pre(ssm_l, A_l, D_l, dtb_l, gw_l, tl.where(s < T2, slot, -1), h, c_x, p_ok, offs_p, dstate,
                            stride_ssm_slot, stride_ssm_head, HAS_D, HAS_DT_BIAS, BLOCK_N)
        out = out_proj_tile_pre(w_out_l, res_l, nw_l, pid * BN3, N_out, d_inner, stride_w_out, BN3, PRE3)
        grid_wait(sync_ptr, (3 * blk + 1) * G)
        _stamp(stamps_ptr, blk, pid, G, 3, TIMELINE)

        # phase 2: the state update and the gate
        for i in tl.static_range(PER2):
            s = pid + i * G
            if i > 0:
                h = tl.minimum(s // P_TILES, n_heads - 1)
                offs_p = (s % P_TILES) * BLOCK_P + tl.arange(0, BLOCK_P)
                p_ok = (offs_p < headdim) & (s < T2)
                c_x = h * headdim + offs_p
                ssu = gated_ssu_pre(ssm_l, A_l, D_l, dtb_l, gw_l, tl.where(s < T2, slot, -1), h, c_x, p_ok, offs_p,
                                    dstate, stride_ssm_slot, stride_ssm_head, HAS_D, HAS_DT_BIAS, BLOCK_N)
            if s < T2:
                state_ptrs, tile_ok, state, w, A, dt_b, Dh = ssu
                c_B = (h // heads_per_group) * dstate + offs_n  # [BLOCK_N] channel of B in x | B | C, less d_inner
                dt = tl.load(proj_ptr + d_inner + conv_dim + h).to(tl.float32)
                zv = tl.load(proj_ptr + c_x, mask=p_ok, other=0.0).to(tl.float32)
                xv = tl.load(xbc_ptr + c_x, mask=p_ok, other=0.0).to(tl.float32)
                Bv = tl.load(xbc_ptr + d_inner + c_B, mask=n_ok, other=0.0).to(tl.float32)
                Cv = tl.load(xbc_ptr + d_inner + gn + c_B, mask=n_ok, other=0.0).to(tl.float32)
                gated_ssu_post(state_ptrs, tile_ok, state, w, A, dt_b, Dh, dt, zv, xv, Bv, Cv, slot >= 0,
                               g_ptr + c_x, sq_ptr + s, p_ok, HAS_D, HAS_DT_BIAS)
        _stamp(stamps_ptr, blk, pid, G, 4, TIMELINE)
        grid_arrive(sync_ptr)
        grid_wait(sync_ptr, (3 * blk + 2) * G)
        _stamp(stamps_ptr, blk, pid, G, 5, TIMELINE)

        # phase 3: out_proj, the residual add, the next norm left pending
        if blk == L - 1:
            x_o = x_out_ptr
            ss_o = ss_out_ptr
            res_o = res_out_ptr
        else:
            x_o = x_buf_ptr + (blk % 2) * N_out
            ss_o = ss_buf_ptr + (blk % 2) * T3
            res_o = res_buf_ptr + (blk % 2) * N_out
        sq = tl.load(sq_ptr + offs_q, mask=offs_q < T2, other=0.0)
        for i in tl.static_range(PER3):
            t = pid + i * G
            if i > 0:
                out = out_proj_tile_pre(w_out_l, res_l, nw_l, t * BN3, N_out, d_inner, stride_w_out, BN3, PRE3)
            if t < T3:
                out_proj_tile_post(out, g_ptr, sq, res_o, x_o, ss_o + t, t * BN3, N_out, d_inner, d_inner, gated_eps,
                                   BN3, BK3, ST3, PRE3)
        _stamp(stamps_ptr, blk, pid, G, 6, TIMELINE)
        if blk < L - 1:
            grid_arrive(sync_ptr)
            # while the slowest out_proj tiles finish: the next block's first in_proj tile's conv
            # taps and weights
            nb = blk + 1
            pre1 = in_proj_tile_pre(w_in_ptr + _layer_off(off_ptr, nb, O_W_IN), conv_ptr + _layer_off(off_ptr, nb, O_CONV),
                                    slot, cw_ptr + _layer_off(off_ptr, nb, O_CW),
                                    cb_ptr + _layer_off(off_ptr, nb, O_CB) if HAS_CONV_BIAS else cb_ptr, pid * BN1,
                                    N_in, K_in, d_inner, conv_dim, stride_w_in, stride_cw_d, stride_cw_k, act,
                                    HAS_CONV_BIAS, WIDTH, BN1, PRE1)
            grid_wait(sync_ptr, (3 * blk + 3) * G)

    # leave: the last program out sets the counts back to zero (every program has passed every
    # barrier when it takes its ticket, so none reads the arrivals any more)
    tl.debug_barrier()
    ticket = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if ticket == G - 1:
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + 1, 0)


class MixerStepLayer(NamedTuple):
    """One Mamba2 block's tensors for the one-launch decode step (same dtypes and shapes every block)."""

    in_weight: Tensor  # [N_in, d] in_proj: z | xBC | dt
    in_bias: Tensor | None  # [N_in]
    conv_state: Tensor  # [slots, conv_dim, width - 1] the block's pool
    conv_weight: Tensor  # [conv_dim, width]
    conv_bias: Tensor | None  # [conv_dim]
    ssm_state: Tensor  # [slots, H, P, N] the block's pool
    A: Tensor  # [H] fp32, -exp(A_log)
    D: Tensor | None  # [H]
    dt_bias: Tensor | None  # [H]
    gated_norm_weight: Tensor  # [d_inner]
    out_weight: Tensor  # [d, d_inner]
    next_norm_weight: Tensor  # [d] the next block's norm (or the final norm)


class MixerStepTiles(NamedTuple):
    # NOTE: in_proj's first prefetch_k weight columns load before the barrier that ends the block before
    in_tile: LinearTile = LinearTile(32, 256, 4, 3, prefetch_k=256)
    out_tile: LinearTile = LinearTile(8, 512, 4, 4, prefetch_k=2048)  # prefetch_k: before the block's first barrier
    block_p: int = 16  # the state update's headdim rows a tile
    num_warps: int = 4
    programs_per_sm: int = 0  # 0: as many as fit (the compiled kernel's registers and shared memory)
    timeline: bool = False  # benchmarks: each program's global-timer stamps into the workspace's `stamps`


class _Table(NamedTuple):
    host: Tensor  # pinned: a CUDA graph's copy reads it at replay
    device: Tensor


class MixerStepWorkspace:
    """On one device: the grid's counts (zero between calls), the grid size per compiled kernel and
    the offsets tables per run of blocks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sync = torch.zeros(4, dtype=torch.int32, device=device)
        self.grids: dict[tuple[object, ...], int] = {}
        self.tables: dict[tuple[int, ...], _Table] = {}
        self.stamps: list[Tensor] = []  # MixerStepTiles.timeline: one [L, G, 8] int64 a call

    def check(self) -> None:
        """Raise if a call's grid was not resident at once (its barrier gave up): a host sync."""
        if int(self.sync[2].item()):
            raise RuntimeError("mixer_step: a grid barrier timed out (the grid was not resident at once)")

    def offsets(self, layers: Sequence[MixerStepLayer]) -> Tensor:
        """[L, NOFF] int64: each block's tensors as element offsets from block 0's, built once a run."""
        kinds = [[ly.in_weight, ly.in_bias, ly.conv_state, ly.conv_weight, ly.conv_bias, ly.ssm_state, ly.A, ly.D,
                  ly.dt_bias, ly.gated_norm_weight, ly.out_weight, ly.next_norm_weight] for ly in layers]
        key = tuple(0 if t is None else t.data_ptr() for row in kinds for t in row)
        table = self.tables.get(key)
        if table is None:
            rows = []
            for row in kinds:
                out = []
                for col, (t, t0) in enumerate(zip(row, kinds[0], strict=True)):
                    if t is None or t0 is None:
                        if (t is None) != (t0 is None):
                            raise ValueError(f"mixer_step: blocks differ in which optional tensors they have (column "
                                             f"{col})")
                        out.append(0)
                        continue
                    if t.dtype != t0.dtype or t.shape != t0.shape or t.stride() != t0.stride():
                        raise ValueError(f"mixer_step: every block's tensor {col} must match block 0's dtype, shape "
                                         f"and strides")
                    delta = t.data_ptr() - t0.data_ptr()
                    if delta % t.element_size():
                        raise ValueError(f"mixer_step: block tensor {col} is not element-aligned with block 0's")
                    out.append(delta // t.element_size())
                rows.append(out)
            host = torch.tensor(rows, dtype=torch.int64)
            if self.device.type == "cuda":  # NOTE: pinned and kept: a CUDA graph's copy reads it at replay
                host = host.pin_memory()
            dev = torch.empty_like(host, device=self.device)
            dev.copy_(host, non_blocking=True)
            table = self.tables[key] = _Table(host, dev)
        return table.device


def resident_programs(kernel: object, device: torch.device) -> int:
    """Programs of a compiled Triton kernel one SM holds at once (registers, shared memory, warps)."""
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    kernel._init_handles()  # type: ignore[attr-defined]  # NOTE: loads the module: n_regs is known after it
    regs = max(1, int(kernel.n_regs))  # type: ignore[attr-defined]
    warps = int(kernel.metadata.num_warps)  # type: ignore[attr-defined]
    smem = int(kernel.metadata.shared)  # type: ignore[attr-defined]
    by_regs = 65536 // (-(-regs // 8) * 8 * 32 * warps)
    by_smem = props["max_shared_mem"] // (smem + 1024) if smem else 32
    return max(0, min(by_regs, by_smem, 64 // warps, 32))


def mixer_stack_step_triton(
    hidden: PendingNorm, residual: Tensor, layers: Sequence[MixerStepLayer], *, state_indices: Tensor, ngroups: int,
    gated_eps: float, norm_eps: float, residual_dtype: torch.dtype, workspace: MixerStepWorkspace,
    tiles: MixerStepTiles | None = None,
) -> tuple[Tensor, PendingNorm]:
    """One row's decode step through `layers` (consecutive Mamba2 blocks) in one launch (module
    docstring): per block in_proj_conv, the gated state update, out_proj_add, on the pending norm
    `hidden` into the first. Returns (residual [1, d] in residual_dtype, PendingNorm(x [1, d], ss
    [1, K], norm_eps)) out of the last."""
    t = tiles or MixerStepTiles()
    ly0 = layers[0]
    if residual.dtype != residual_dtype:
        raise ValueError(f"mixer_step: the residual in ({residual.dtype}) and out ({residual_dtype}) share a dtype")
    x, dev = hidden.x, hidden.x.device
    L = len(layers)
    _, H, P, Nst = ly0.ssm_state.shape
    d_inner, conv_dim = H * P, ly0.conv_weight.shape[0]
    N_in, K_in = ly0.in_weight.shape
    p_tiles = cdiv(P, t.block_p)
    T1, T2, T3 = cdiv(N_in, t.in_tile.block_n), H * p_tiles, cdiv(K_in, t.out_tile.block_n)
    proj = torch.empty((1, N_in), dtype=x.dtype, device=dev)  # [1, N_in]
    xbc = torch.empty((1, conv_dim), dtype=x.dtype, device=dev)  # [1, conv_dim]
    g = torch.empty((1, d_inner), dtype=x.dtype, device=dev)  # [1, d_inner]
    sq = torch.empty((1, T2), dtype=torch.float32, device=dev)  # [1, T2]
    nw_dtype = ly0.next_norm_weight.dtype
    new = torch.empty((1, K_in), dtype=residual_dtype, device=dev)  # [1, d]
    x_out = torch.empty((1, K_in), dtype=nw_dtype, device=dev)  # [1, d]
    ss_out = torch.empty((1, T3), dtype=torch.float32, device=dev)  # [1, T3]
    # ping-pong between blocks: block l writes buffer l % 2
    x_buf = torch.empty((2, K_in), dtype=nw_dtype, device=dev)
    ss_buf = torch.empty((2, T3), dtype=torch.float32, device=dev)
    res_buf = torch.empty((2, K_in), dtype=residual_dtype, device=dev)
    offsets = workspace.offsets(layers)
    pdl = use_pdl(x)
    stamps = None
    if t.timeline:  # [L, G, 8] (G <= the most tiles of a phase)
        stamps = torch.zeros((L, max(T1, T2, T3), 8), dtype=torch.int64, device=dev)
        workspace.stamps.append(stamps)
    args = (ly0.in_weight, ly0.in_bias, ly0.conv_state, ly0.conv_weight, ly0.conv_bias, ly0.ssm_state,
            ly0.A.contiguous(), ly0.D, ly0.dt_bias, ly0.gated_norm_weight, ly0.out_weight, ly0.next_norm_weight,
            offsets, x, hidden.ss.contiguous(), residual.contiguous(), x_out, ss_out, new, x_buf, ss_buf, res_buf,
            proj, xbc, g, sq, state_indices.contiguous(), workspace.sync, stamps,
            N_in, K_in, d_inner, conv_dim, hidden.ss.shape[1], float(hidden.eps), P, Nst, H // ngroups, H,
            ngroups * Nst, float(gated_eps), float(norm_eps),
            ly0.in_weight.stride(0), ly0.conv_weight.stride(0), ly0.conv_weight.stride(1), ly0.ssm_state.stride(0),
            ly0.ssm_state.stride(1), ly0.out_weight.stride(0))

    def meta(grid: int) -> dict[str, object]:
        return dict(L=L, HAS_BIAS=ly0.in_bias is not None, HAS_CONV_BIAS=ly0.conv_bias is not None,
                    WIDTH=ly0.conv_weight.shape[1], FAST_EXP=x.is_cuda, HAS_D=ly0.D is not None,
                    HAS_DT_BIAS=ly0.dt_bias is not None, BN1=t.in_tile.block_n, BK1=t.in_tile.block_k,
                    ST1=t.in_tile.num_stages, PRE1=t.in_tile.prefetch_k, PER1=cdiv(T1, grid),
                    SS_BLOCK=pow2(max(hidden.ss.shape[1], T3)), BLOCK_P=t.block_p, BLOCK_N=pow2(Nst),
                    P_TILES=p_tiles, PER2=cdiv(T2, grid), BN3=t.out_tile.block_n, BK3=t.out_tile.block_k,
                    ST3=t.out_tile.num_stages, PRE3=t.out_tile.prefetch_k, PER3=cdiv(T3, grid), SQ_BLOCK=pow2(T2),
                    PDL=pdl, TIMELINE=t.timeline, num_warps=t.num_warps, **launch_options(pdl))

    with on_device(x):
        if not x.is_cuda:  # the interpreter runs programs one after another: one program does all
            _mixer_stack_kernel[(1,)](*args, **meta(1))
        else:
            key = (dev, t, L, ly0.in_bias is None, ly0.conv_bias is None, ly0.D is None, ly0.dt_bias is None, x.dtype,
                   N_in, K_in, H, P, Nst)
            grid = workspace.grids.get(key)
            if grid is None:
                # NOTE: compiled for one tile a phase to learn how many programs fit, then for the grid's
                # own trip counts (one tile a phase at the 2.7B shape: the same kernel)
                k = _mixer_stack_kernel.warmup(*args, grid=(1,), **meta(max(T1, T2, T3)))
                per_sm = resident_programs(k, dev)
                if t.programs_per_sm:
                    per_sm = min(per_sm, t.programs_per_sm)
                if per_sm < 1:
                    raise RuntimeError(f"mixer_step: tiles {t} do not fit one program on a SM")
                grid = min(num_sms(dev) * per_sm, max(T1, T2, T3))
                k = _mixer_stack_kernel.warmup(*args, grid=(grid,), **meta(grid))
                if resident_programs(k, dev) * num_sms(dev) < grid:
                    raise RuntimeError(f"mixer_step: {grid} programs do not fit at once (tiles {t})")
                workspace.grids[key] = grid
            _mixer_stack_kernel[(grid,)](*args, **meta(grid))
    return new, PendingNorm(x_out, ss_out, float(norm_eps))
