"""The SSD's chunk states and their passing along each sequence in one launch, one program per
(head, sequence, dstate block) walking the sequence's chunks in order.

Replaces `_ssd_chunk_state_kernel` + `_ssd_state_passing_kernel` (ssd_triton_kernels.py) in
batches of short sequences (SSDConfig.serial_max_tokens). Those two write each chunk's own end state [K, H, P, N] in fp32 and
read it back (0.67 GB at 1 x 32768 on Mamba2-2.7B shapes, a third of what the four launches move); here a
chunk's end state lives only in registers: the program adds it to the running state it carries and
stores just the state entering each chunk, which the scan needs anyway. The price is parallelism:
H * S * (N / BLOCK_N) programs (grid [N / BLOCK_N, H, S]), each sequential over its sequence's
chunks; the chunks' loads do not depend on the running state, so the loop's software pipeline
fetches the next step's tiles while one is reduced.

The loop runs over steps of STEP tokens (a whole chunk, or CHUNK / STEP steps of one), counted so
that no step lies wholly past a chunk's end: where boundary states tie chunks to absolute
positions, a sequence starting mid-chunk has a short first chunk; its last chunk may be short.
A step of tokens [a, a + STEP) of a chunk:
  dt'   = clamp(softplus(dt + dt_bias))             0 past the chunk's L; stored to dt_buf
  cs    = the chunk's running sum of dt' * A         flat past L; stored to cs_buf
  state = e^{d} state + x^T diag(dt' e^{cs_b - cs}) B   d = the step's own sum of dt' * A, cs_b its
                                                         last running sum; fp32 accumulation
which is the chunk-end formula taken a step at a time (every e^{...} is of a sum <= 0). The state
entering a chunk is stored (dot dtype) at its first step for the scan; at its last step the rest of
dt_buf / cs_buf up to CHUNK is filled (0 / flat) as the two-kernel path leaves it, and a boundary
state (a chunk ending on an absolute multiple of the model's chunk, bound_chunks * CHUNK) is
stored when asked for. The final state goes to the pool slot in place.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pd_ssm.kernels.ssd_triton_kernels import _boundary_row, _cast, _dot, _dt_of


@triton.jit
def _step_place(it, f, c0, c1, r, CHUNK: tl.constexpr, STEP: tl.constexpr):
    """(chunk j of the sequence, step i of that chunk, the chunk's first token t0 and length L) of
    walk step `it`, from the step count alone: so the loop's loads depend on nothing loaded in the
    loop. f = the first chunk's steps; every later chunk but the last is whole."""
    SUBS: tl.constexpr = CHUNK // STEP
    later = it >= f
    j = tl.where(later, 1 + (it - f) // SUBS, 0)
    i = tl.where(later, (it - f) % SUBS, it)
    t0 = c0 + tl.maximum(j * CHUNK - r, 0)
    L = tl.minimum(c0 + (j + 1) * CHUNK - r, c1) - t0
    return j, i, t0, L


@triton.jit
def _step_dt(dt_col, stride_dt_t, it, steps, f, c0, c1, r, CHUNK: tl.constexpr, STEP: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """Walk step `it`'s raw dt [BLOCK_K] (this head's column), 0 past its chunk and past the walk."""
    _, i, t0, L = _step_place(it, f, c0, c1, r, CHUNK, STEP)
    pos = i * STEP + tl.arange(0, BLOCK_K)
    return tl.load(dt_col + (t0 + pos).to(tl.int64) * stride_dt_t, mask=(pos < L) & (it < steps), other=0.0)


@triton.jit(do_not_specialize=["K_max"])
def _ssd_state_serial_kernel(
    # pointers
    x_ptr, dt_ptr, A_ptr, dt_bias_ptr, B_ptr, cu_ptr, ctx_ptr, seq_first_ptr, bcu_ptr, state_idx_ptr,
    has_init_ptr,  # inputs
    dt_buf_ptr, cs_buf_ptr, starts_ptr, pool_ptr, bstates_ptr,  # outputs (pool in place)
    x_desc, B_desc,  # when TMA: x as [T, H * P], B as [T, G * N] (else unused)
    # dimensions
    K_max, nheads, headdim, dstate, heads_per_group, dt_min, dt_max,
    # strides (token, head / group); the last axes have stride 1
    stride_x_t, stride_x_h, stride_dt_t, stride_dt_h, stride_B_t, stride_B_g,
    bound_chunks,  # chunks between two boundary states (the model's chunk / CHUNK)
    # meta-parameters
    CHUNK: tl.constexpr, CHUNK_PAD: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr, TMA: tl.constexpr, RETURN_BOUNDARY: tl.constexpr,
    STEP: tl.constexpr,  # tokens a step: CHUNK, or a power of two dividing it
    BLOCK_K: tl.constexpr,  # rows of a step's tiles: STEP, or CHUNK_PAD when STEP is CHUNK
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # NOTE: the dstate blocks of one (head, sequence) are neighbours in the grid, so they run at the
    # same time and the second reads the x tiles the first brought into L2; with the blocks on the
    # slowest axis a whole grid of programs ran between them and x came from DRAM twice (ncu, H200,
    # 16 x 1024 tokens: DRAM 68% busy, L2 hit rate 53%)
    nb = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    first = tl.load(seq_first_ptr + s)
    c0 = tl.load(cu_ptr + s)
    c1 = tl.load(cu_ptr + s + 1)
    # NOTE: chunks from the sequence's first token unless boundary states need them at absolute
    # multiples of the chunk (the meta kernel says why)
    ctx = tl.load(ctx_ptr + s, mask=RETURN_BOUNDARY, other=0)
    r = ctx % CHUNK  # a mid-chunk start makes the first chunk CHUNK - r long
    b0 = tl.load(bcu_ptr + s)
    A_h = tl.load(A_ptr + h)
    g = h // heads_per_group
    PN = headdim * dstate
    SUBS: tl.constexpr = CHUNK // STEP  # steps in a whole chunk
    L0 = tl.minimum(CHUNK - r, c1 - c0)  # the first chunk's length
    f = (L0 + STEP - 1) // STEP  # its steps; every later chunk but the last is whole
    steps = f + (c1 - c0 - L0 + STEP - 1) // STEP

    offs_p = tl.arange(0, BLOCK_P)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mpn = (offs_p[:, None] < headdim) & (offs_n[None, :] < dstate)
    tile = offs_p[:, None] * dstate + offs_n[None, :]
    slot = tl.load(state_idx_ptr + s).to(tl.int64)
    pool_ptrs = pool_ptr + (slot * nheads + h) * PN + tile
    state = tl.load(pool_ptrs, mask=mpn & (tl.load(has_init_ptr + s) != 0), other=0.0).to(tl.float32)

    step = tl.arange(0, BLOCK_K)
    tok = tl.arange(0, CHUNK_PAD)
    carry = tl.zeros([], dtype=tl.float32)  # the chunk's running sum before this step
    bias = tl.load(dt_bias_ptr + h).to(tl.float32) if HAS_DT_BIAS else 0.0
    dt_col = dt_ptr + h * stride_dt_h
    # NOTE: each step's raw dt is loaded one step ahead, by hand: Triton's pipeliner leaves this
    # load (it feeds a scan and a reduction, not a dot) synchronous, and a global load's latency
    # a step would sit on the walk's one dependent chain (sm_90 TTGIR, session 14)
    dt_raw = _step_dt(dt_col, stride_dt_t, 0, steps, f, c0, c1, r, CHUNK, STEP, BLOCK_K)
    for it in range(0, steps):
        j, i, t0, L = _step_place(it, f, c0, c1, r, CHUNK, STEP)
        k = (first + j).to(tl.int64)
        pos = i * STEP + step
        live = pos < L
        row = t0 + i * STEP
        dt_cur = dt_raw
        dt_raw = _step_dt(dt_col, stride_dt_t, it + 1, steps, f, c0, c1, r, CHUNK, STEP, BLOCK_K)
        dt_s = _dt_of(dt_cur, live, bias, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT)
        cs_s = tl.cumsum(dt_s * A_h, 0)  # from the step's start
        d = tl.sum(tl.where(step == BLOCK_K - 1, cs_s, 0.0), 0)  # the step's sum (flat past L)
        carry = tl.where(i == 0, 0.0, carry)
        buf = (h * K_max + k) * CHUNK
        keep = (pos < CHUNK) & (nb == 0)  # every dstate block computes them; one stores
        tl.store(dt_buf_ptr + buf + pos, dt_s, mask=keep)
        tl.store(cs_buf_ptr + buf + pos, cs_s + carry, mask=keep)
        end = (i + 1) * STEP >= L  # the chunk's last step
        if SUBS > 1:
            if end:
                rest = (tok >= (i + 1) * STEP) & (tok < CHUNK) & (nb == 0)
                tl.store(dt_buf_ptr + buf + tok, tl.zeros([CHUNK_PAD], dtype=tl.float32), mask=rest)
                tl.store(cs_buf_ptr + buf + tok, tl.zeros([CHUNK_PAD], dtype=tl.float32) + (carry + d), mask=rest)
        carry += d
        w = dt_s * tl.exp(d - cs_s)  # [BLOCK_K], 0 past L
        if TMA:
            # NOTE: whole tiles, zero past the last token; the tokens past L (the next sequence's)
            # get w = 0, so they add nothing (the launcher checks the tiles are P and N wide)
            xT = tl.trans(x_desc.load([row, h * headdim]))  # [BLOCK_P, BLOCK_K]
            Bk = B_desc.load([row, g * dstate + nb * BLOCK_N])  # [BLOCK_K, BLOCK_N]
        else:
            rows = row.to(tl.int64) + step
            xT = tl.load(x_ptr + h * stride_x_h + offs_p[:, None] + rows[None, :] * stride_x_t,
                         mask=(offs_p[:, None] < headdim) & live[None, :], other=0.0)
            Bk = tl.load(B_ptr + g * stride_B_g + rows[:, None] * stride_B_t + offs_n[None, :],
                         mask=live[:, None] & (offs_n[None, :] < dstate), other=0.0)
        if i == 0:
            tl.store(starts_ptr + (k * nheads + h) * PN + tile, _cast(state, starts_ptr.dtype.element_ty, INTERPRETED),
                     mask=mpn)
        xw = _cast(xT.to(tl.float32) * w[None, :], DOT_DTYPE, INTERPRETED)
        state = _dot(xw, _cast(Bk, DOT_DTYPE, INTERPRETED), state * tl.exp(d), DOT_PRECISION, INTERPRETED)
        if RETURN_BOUNDARY:
            if end:
                brow = _boundary_row(ctx, j, c1 - c0, CHUNK, bound_chunks)
                tl.store(bstates_ptr + ((b0 + brow).to(tl.int64) * nheads + h) * PN + tile, state,
                         mask=mpn & (brow >= 0))
    tl.store(pool_ptrs, _cast(state, pool_ptr.dtype.element_ty, INTERPRETED), mask=mpn)
