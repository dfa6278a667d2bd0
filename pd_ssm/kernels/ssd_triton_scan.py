"""The chunk-scan kernel of the varlen SSD scan (launch 4 of 4; see ssd_triton_kernels.py).

Per (head group, row block, logical chunk): the rows' view of the state entering the chunk,
C·state·e^{cs}, plus the causal part inside the chunk, (C B^T ∘ e^{cs_l - cs_s} dt'_s + D I) x,
with C B^T either made block by block in the kernel (no CB tensor, no bmm launch) or, with
CB_LOADED, read from the per-(chunk, group) product of ssd_triton_bmm.py (made once, not per head).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pd_ssm.kernels.pdl import pdl_gate
from pd_ssm.kernels.ssd_triton_kernels import _cast, _dot


@triton.jit
def _scan_c_rows(C_ptr, C_desc, t0, mb, g, dstate, offs_m, offs_n, mm, mn, stride_C_t, stride_C_g,
                 DOT_DTYPE: tl.constexpr, INTERPRETED: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr):
    """The row block's C of its group, [BLOCK_M, BLOCK_N] in the dot dtype."""
    if TMA:
        C_m = C_desc.load([(t0 + mb * BLOCK_M).to(tl.int32), g * dstate])
    else:
        C_m = tl.load(C_ptr + t0 * stride_C_t + g * stride_C_g + offs_m[:, None] * stride_C_t + offs_n[None, :],
                      mask=mm[:, None] & mn[None, :], other=0.0)
    return _cast(C_m, DOT_DTYPE, INTERPRETED)


@triton.jit
def _scan_state_part(C_m, h, k, nheads, headdim, dstate, starts_ptr, cs_m, offs_p, offs_n, mp, mn,
                     DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """One head's rows' view of the state entering the chunk: C·state·e^{cs}, [BLOCK_M, BLOCK_P] fp32."""
    stT = tl.load(starts_ptr + (k * nheads + h) * (headdim * dstate) + offs_p[None, :] * dstate + offs_n[:, None],
                  mask=mn[:, None] & mp[None, :], other=0.0)
    stT = _cast(stT, DOT_DTYPE, INTERPRETED)  # [BLOCK_N, BLOCK_P]
    return _dot(C_m, stT, None, DOT_PRECISION, INTERPRETED) * tl.exp(cs_m)[:, None]


@triton.jit
def _scan_head_start(C_m, h, k, nheads, headdim, dstate, cs_buf_ptr, buf, starts_ptr, offs_m, offs_p, offs_n, mp,
                     mn, CHUNK: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     INTERPRETED: tl.constexpr):
    """One head's rows: the entering state's contribution C·state·e^{cs}, and their cs."""
    cs_m = tl.load(cs_buf_ptr + buf + offs_m, mask=offs_m < CHUNK, other=0.0)
    acc = _scan_state_part(C_m, h, k, nheads, headdim, dstate, starts_ptr, cs_m, offs_p, offs_n, mp, mn, DOT_DTYPE,
                           DOT_PRECISION, INTERPRETED)  # [BLOCK_M, BLOCK_P]
    return acc, cs_m


@triton.jit
def _scan_sources(cs_buf_ptr, dt_buf_ptr, buf, offs_k, mk):
    """cs and dt' of one block of source tokens (0 where mk is off: past the chunk's L)."""
    cs_k = tl.load(cs_buf_ptr + buf + offs_k, mask=mk, other=0.0)
    dt_k = tl.load(dt_buf_ptr + buf + offs_k, mask=mk, other=0.0)
    return cs_k, dt_k


@triton.jit
def _scan_cb_rows(cb_base, offs_m, offs_k, rows, CHUNK: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] tile of the loaded C B^T in fp32, from a block the CB kernel wrote whole
    (see the launcher): only a row mask `rows` [BLOCK_M, 1], constant along the contiguous axis, so
    the loads stay vectorized; the entries above the diagonal are finite and get zero weight in the
    step."""
    return tl.load(cb_base + offs_m[:, None] * CHUNK + offs_k[None, :], mask=rows, other=0.0).to(tl.float32)


@triton.jit
def _scan_cb_tile(cb_base, offs_m, offs_k, mm, mk, causal, CHUNK: tl.constexpr, CB_WHOLE_TILES: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] tile of the loaded C B^T, fp32."""
    if CB_WHOLE_TILES:
        return _scan_cb_rows(cb_base, offs_m, offs_k, mm[:, None], CHUNK)
    # NOTE: the CB kernel wrote only s <= l < L (block-wise): mask to exactly that
    cb = tl.load(cb_base + offs_m[:, None] * CHUNK + offs_k[None, :], mask=causal & mm[:, None] & mk[None, :],
                 other=0.0)
    return cb.to(tl.float32)


@triton.jit
def _scan_head_step(acc, cb, cs_k, dt_k, causal, diag, D_h, cs_m, x_base, offs_k, mk, offs_p, mp, stride_x_t, x_desc,
                    x_row, x_col, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
                    TMA: tl.constexpr):
    """acc += (C B^T ∘ e^{cs_l - cs_s} dt'_s + D I) x over one block of source tokens s, for one head.

    D rides on the diagonal of the weights (no separate load of x for D x); with bf16 dots D·x is
    then rounded like the other weights, with fp32 dots it is exact. TMA: the x tile comes through
    its descriptor at (x_row, x_col), unmasked (the kernel says why that is exact).
    """
    decay = tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf")))
    w = _cast(cb * decay * dt_k[None, :] + tl.where(diag, D_h, 0.0), DOT_DTYPE, INTERPRETED)
    if TMA:
        xk = x_desc.load([x_row, x_col])
    else:
        xk = tl.load(x_base + offs_k[:, None] * stride_x_t + offs_p[None, :], mask=mk[:, None] & mp[None, :],
                     other=0.0)
    xk = _cast(xk, DOT_DTYPE, INTERPRETED)  # [BLOCK_K, BLOCK_P]
    return _dot(w, xk, acc, DOT_PRECISION, INTERPRETED)


@triton.jit
def _dot_done(acc, INTERPRETED: tl.constexpr):
    """acc, once the dots that made it have finished: an opaque identity (one mov a value) makes
    Triton wait for the wgmma group here instead of leaving the step's last one in flight across
    the loop edge, where it still reads its A operand (the weights) from registers that the next
    step's first instructions may already reuse."""
    if not INTERPRETED:
        acc = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1)
    return acc


@triton.jit
def _scan_head_store(acc, h, out_ptr, t0, offs_m, offs_p, mm, mp, stride_o_t, stride_o_h,
                     INTERPRETED: tl.constexpr):
    tl.store(out_ptr + (t0 + offs_m[:, None]) * stride_o_t + h * stride_o_h + offs_p[None, :],
             _cast(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=mm[:, None] & mp[None, :])


@triton.jit(do_not_specialize=["K_max"])
def _ssd_chunk_scan_kernel(
    # pointers
    x_ptr, B_ptr, C_ptr, D_ptr, dt_buf_ptr, cs_buf_ptr, starts_ptr, chunk_ptr,  # inputs
    cb_ptr,  # input when CB_LOADED: [K_max, G, CHUNK, CHUNK] C B^T per (chunk, group)
    out_ptr,  # output
    x_desc, B_desc, C_desc,  # when TMA: x as [T, H * P], B and C as [T, G * N] (else unused)
    # dimensions
    K_max, nheads, headdim, dstate, heads_per_group, ngroups,
    # strides (token, head / group); the last axes have stride 1
    stride_x_t, stride_x_h, stride_B_t, stride_B_g, stride_C_t, stride_C_g, stride_o_t, stride_o_h,
    # meta-parameters
    CHUNK: tl.constexpr, HAS_D: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr, HEADS: tl.constexpr, HEAD_LOOP: tl.constexpr, CB_LOADED: tl.constexpr,
    CB_WHOLE_TILES: tl.constexpr, TMA: tl.constexpr, PREFETCH: tl.constexpr, LATE_START: tl.constexpr,
    PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # LATE_START (one head, PREFETCH; ssd_config.scan_overlap): the causal part first, then the PDL gate
    # (pdl.py: the passing kernel, launched just before, has written the entering states), then the
    # entering state's part. Everything read before the gate is from launches two or more back.
    # HEADS (1, 2 or 4) consecutive heads of one group share this program's C and B tiles and each
    # C B^T block: the product is made once for all of them. HEAD_LOOP such sets run one after the
    # other in the same program (longer-lived programs; with CB_LOADED the CB tiles are re-read
    # from cache rather than recomputed).
    mb = tl.num_programs(1) - 1 - tl.program_id(1)  # the longest row blocks start first
    k = tl.program_id(2).to(tl.int64)
    t0 = tl.load(chunk_ptr + 4 * k + 1).to(tl.int64)
    L = tl.load(chunk_ptr + 4 * k + 2)
    if mb * BLOCK_M >= L:
        pdl_gate(PDL)  # every program passes the gate (pdl.py, contract 4)
        return
    g = (tl.program_id(0) * (HEADS * HEAD_LOOP)) // heads_per_group
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mm = offs_m < L
    mp = offs_p < headdim
    mn = offs_n < dstate
    # NOTE (TMA): tiles come whole through descriptors, zero past the last token; rows past the
    # chunk's L (the next sequence's tokens) are read too. They change nothing: a row l >= L is
    # never stored, and a source s >= L > l of a row that is stored has zero weight (causal mask,
    # dt' loaded as 0). Tiles are exactly P and N wide (the launcher checks): no other head or group
    if not LATE_START:  # else loaded after the gate: not held in registers through the causal loop
        C_m = _scan_c_rows(C_ptr, C_desc, t0, mb, g, dstate, offs_m, offs_n, mm, mn, stride_C_t, stride_C_g,
                           DOT_DTYPE, INTERPRETED, TMA, BLOCK_M)
    B_base = B_ptr + t0 * stride_B_t + g * stride_B_g
    cb_base = cb_ptr + (k * ngroups + g) * (CHUNK * CHUNK)  # [CHUNK, CHUNK] of this (chunk, group)
    for it in range(HEAD_LOOP):
        h0 = (tl.program_id(0) * HEAD_LOOP + it) * HEADS
        D0, D1, D2, D3 = 0.0, 0.0, 0.0, 0.0
        if HAS_D:
            D0 = tl.load(D_ptr + h0).to(tl.float32)
            if HEADS >= 2:
                D1 = tl.load(D_ptr + h0 + 1).to(tl.float32)
            if HEADS >= 4:
                D2 = tl.load(D_ptr + h0 + 2).to(tl.float32)
                D3 = tl.load(D_ptr + h0 + 3).to(tl.float32)
        buf0 = (h0 * K_max + k) * CHUNK
        xb0 = x_ptr + t0 * stride_x_t + h0 * stride_x_h
        if LATE_START:
            cs0 = tl.load(cs_buf_ptr + buf0 + offs_m, mask=offs_m < CHUNK, other=0.0)
            acc0 = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        else:
            acc0, cs0 = _scan_head_start(C_m, h0, k, nheads, headdim, dstate, cs_buf_ptr, buf0, starts_ptr, offs_m,
                                         offs_p, offs_n, mp, mn, CHUNK, DOT_DTYPE, DOT_PRECISION, INTERPRETED)
        if HEADS >= 2:
            buf1 = buf0 + K_max * CHUNK
            xb1 = xb0 + stride_x_h
            acc1, cs1 = _scan_head_start(C_m, h0 + 1, k, nheads, headdim, dstate, cs_buf_ptr, buf1, starts_ptr,
                                         offs_m, offs_p, offs_n, mp, mn, CHUNK, DOT_DTYPE, DOT_PRECISION, INTERPRETED)
        if HEADS >= 4:
            buf2 = buf0 + 2 * K_max * CHUNK
            buf3 = buf0 + 3 * K_max * CHUNK
            xb2 = xb0 + 2 * stride_x_h
            xb3 = xb0 + 3 * stride_x_h
            acc2, cs2 = _scan_head_start(C_m, h0 + 2, k, nheads, headdim, dstate, cs_buf_ptr, buf2, starts_ptr,
                                         offs_m, offs_p, offs_n, mp, mn, CHUNK, DOT_DTYPE, DOT_PRECISION, INTERPRETED)
            acc3, cs3 = _scan_head_start(C_m, h0 + 3, k, nheads, headdim, dstate, cs_buf_ptr, buf3, starts_ptr,
                                         offs_m, offs_p, offs_n, mp, mn, CHUNK, DOT_DTYPE, DOT_PRECISION, INTERPRETED)

        # causal part inside the chunk: y_l += sum_{s<=l} (C_l . B_s) exp(cs_l - cs_s) dt'_s x_s
        end = tl.minimum((mb + 1) * BLOCK_M, L)
        if PREFETCH:
            # NOTE: one head, C B^T loaded in whole tiles (the launcher checks). The C B^T tile, cs
            # and dt' of the next step are loaded into registers one step ahead: the pipeliner gives
            # them one shared buffer each at two stages and waits out their latency at every step's
            # top. The masks stop the look-ahead at the loop's end, where the C B^T block right of
            # the diagonal was never written (its scratch may hold NaN, and NaN * 0 is NaN)
            offs_k = tl.arange(0, BLOCK_K)
            cb_next = _scan_cb_rows(cb_base, offs_m, offs_k, mm[:, None], CHUNK)
            cs_next, dt_next = _scan_sources(cs_buf_ptr, dt_buf_ptr, buf0, offs_k, offs_k < L)
            for kb in range(0, end, BLOCK_K):
                offs_k = kb + tl.arange(0, BLOCK_K)
                cb, cs_k, dt_k = cb_next, cs_next, dt_next
                more = kb + BLOCK_K < end
                nk = offs_k + BLOCK_K
                cb_next = _scan_cb_rows(cb_base, offs_m, nk, mm[:, None] & more, CHUNK)
                cs_next, dt_next = _scan_sources(cs_buf_ptr, dt_buf_ptr, buf0, nk, (nk < L) & more)
                acc0 = _scan_head_step(acc0, cb, cs_k, dt_k, offs_m[:, None] >= offs_k[None, :],
                                       offs_m[:, None] == offs_k[None, :], D0, cs0, xb0, offs_k, offs_k < L, offs_p,
                                       mp, stride_x_t, x_desc, (t0 + kb).to(tl.int32), h0 * headdim, DOT_DTYPE,
                                       DOT_PRECISION, INTERPRETED, TMA)
                acc0 = _dot_done(acc0, INTERPRETED)
        else:
            for kb in range(0, end, BLOCK_K):
                offs_k = kb + tl.arange(0, BLOCK_K)
                mk = offs_k < L
                causal = offs_m[:, None] >= offs_k[None, :]
                diag = offs_m[:, None] == offs_k[None, :]
                if CB_LOADED:
                    cb = _scan_cb_tile(cb_base, offs_m, offs_k, mm, mk, causal, CHUNK, CB_WHOLE_TILES)
                elif TMA:
                    BT = tl.trans(_cast(B_desc.load([(t0 + kb).to(tl.int32), g * dstate]), DOT_DTYPE, INTERPRETED))
                    cb = _dot(C_m, BT, None, DOT_PRECISION, INTERPRETED)  # [BLOCK_M, BLOCK_K] fp32
                else:
                    BT = tl.load(B_base + offs_k[None, :] * stride_B_t + offs_n[:, None],
                                 mask=mn[:, None] & mk[None, :], other=0.0)
                    BT = _cast(BT, DOT_DTYPE, INTERPRETED)  # [BLOCK_N, BLOCK_K]
                    cb = _dot(C_m, BT, None, DOT_PRECISION, INTERPRETED)  # [BLOCK_M, BLOCK_K] fp32
                x_row = (t0 + kb).to(tl.int32)
                cs_k, dt_k = _scan_sources(cs_buf_ptr, dt_buf_ptr, buf0, offs_k, mk)
                acc0 = _scan_head_step(acc0, cb, cs_k, dt_k, causal, diag, D0, cs0, xb0, offs_k, mk, offs_p, mp,
                                       stride_x_t, x_desc, x_row, h0 * headdim, DOT_DTYPE, DOT_PRECISION,
                                       INTERPRETED, TMA)
                if HEADS >= 2:
                    cs_k, dt_k = _scan_sources(cs_buf_ptr, dt_buf_ptr, buf1, offs_k, mk)
                    acc1 = _scan_head_step(acc1, cb, cs_k, dt_k, causal, diag, D1, cs1, xb1, offs_k, mk, offs_p, mp,
                                           stride_x_t, x_desc, x_row, (h0 + 1) * headdim, DOT_DTYPE, DOT_PRECISION,
                                           INTERPRETED, TMA)
                if HEADS >= 4:
                    cs_k, dt_k = _scan_sources(cs_buf_ptr, dt_buf_ptr, buf2, offs_k, mk)
                    acc2 = _scan_head_step(acc2, cb, cs_k, dt_k, causal, diag, D2, cs2, xb2, offs_k, mk, offs_p, mp,
                                           stride_x_t, x_desc, x_row, (h0 + 2) * headdim, DOT_DTYPE, DOT_PRECISION,
                                           INTERPRETED, TMA)
                    cs_k, dt_k = _scan_sources(cs_buf_ptr, dt_buf_ptr, buf3, offs_k, mk)
                    acc3 = _scan_head_step(acc3, cb, cs_k, dt_k, causal, diag, D3, cs3, xb3, offs_k, mk, offs_p, mp,
                                           stride_x_t, x_desc, x_row, (h0 + 3) * headdim, DOT_DTYPE, DOT_PRECISION,
                                           INTERPRETED, TMA)
                if CB_LOADED:
                    # NOTE: as in the look-ahead loop: nothing else waits the step's wgmma (the fused
                    # scan's next C B^T dot waits it before the weights that reuse its registers)
                    acc0 = _dot_done(acc0, INTERPRETED)
                    if HEADS >= 2:
                        acc1 = _dot_done(acc1, INTERPRETED)
                    if HEADS >= 4:
                        acc2 = _dot_done(acc2, INTERPRETED)
                        acc3 = _dot_done(acc3, INTERPRETED)

        if LATE_START:
            pdl_gate(PDL)
            C_m = _scan_c_rows(C_ptr, C_desc, t0, mb, g, dstate, offs_m, offs_n, mm, mn, stride_C_t, stride_C_g,
                               DOT_DTYPE, INTERPRETED, TMA, BLOCK_M)
            acc0 += _scan_state_part(C_m, h0, k, nheads, headdim, dstate, starts_ptr, cs0, offs_p, offs_n, mp, mn,
                                     DOT_DTYPE, DOT_PRECISION, INTERPRETED)
        _scan_head_store(acc0, h0, out_ptr, t0, offs_m, offs_p, mm, mp, stride_o_t, stride_o_h, INTERPRETED)
        if HEADS >= 2:
            _scan_head_store(acc1, h0 + 1, out_ptr, t0, offs_m, offs_p, mm, mp, stride_o_t,
                             stride_o_h, INTERPRETED)
        if HEADS >= 4:
            _scan_head_store(acc2, h0 + 2, out_ptr, t0, offs_m, offs_p, mm, mp, stride_o_t,
                             stride_o_h, INTERPRETED)
            _scan_head_store(acc3, h0 + 3, out_ptr, t0, offs_m, offs_p, mm, mp, stride_o_t,
                             stride_o_h, INTERPRETED)
