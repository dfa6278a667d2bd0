"""Triton kernels of the varlen SSD chunked scan; the launcher is `ssd_triton.py`.

A "logical chunk" is a run of at most CHUNK tokens of one sequence between two absolute multiples
of CHUNK (a sequence's first and last chunks may be short) where boundary states are asked for;
without them, between two multiples of CHUNK counted from the sequence's first token (only the last
chunk may be short). Four launches:

  1. _ssd_chunk_meta_kernel      one program: logical chunks from cu_seqlens / context_lens
  2. _ssd_chunk_state_kernel     (head, chunk, dstate block): dt' and its cumsum, the chunk's own
                                 end state (dt' and its cumsum by _ssd_chunk_dt_kernel, (head, chunk),
                                 launched first, where SSDConfig.state_dt_launch says so)
  3. _ssd_state_passing_kernel   (block of P*N, seq, head): start states along each sequence
  4. _ssd_chunk_scan_kernel      (head group, row block, chunk): C·state + causal (C B^T ∘ decay) x
                                 + D x, in ssd_triton_scan.py

Scratch layouts (K = K_max logical chunks, Q = CHUNK, H heads, PN = headdim * dstate):
  chunk_info  [K, 4] int32   (sequence, first token, length (0: no such chunk), boundary row or -1)
  dt_buf      [H, K, Q] fp32 dt' (0 past the chunk's end)
  cs_buf      [H, K, Q] fp32 inclusive cumsum of dt' * A from the chunk start (flat past the end)
  states      [K, H, PN] fp32 (or the dot dtype: chunk_states_low) each chunk's end state from zero
  cb          [K, G, Q, Q] fp32 or dot dtype, C B^T per (chunk, group) (only with scan_cb != "fused")
  starts      [K, H, PN] dot dtype, the state entering each chunk
"""

from __future__ import annotations

import triton
import triton.language as tl

from pd_ssm.kernels.pdl import pdl_gate


@triton.jit
def _softplus(x):
    # log1p(exp(x)) without libdevice (absent in the interpreter): log(u) * e / (u - 1) undoes the
    # rounding of u = 1 + e, which a plain log(1 + e) would keep when dt' is small
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    d = u - 1.0
    return tl.maximum(x, 0.0) + tl.where(d == 0.0, e, tl.log(u) * (e / d))


# INTERPRETED (TRITON_INTERPRET=1) works around two faults of Triton 3.6's interpreter with bf16:
# its dot multiplies bf16 operands as raw integers, and its fp32 -> bf16 cast truncates. Operands
# already rounded to bf16 have exact fp32 products (what the GPU's bf16 dot sums), and rounding
# to nearest even by hand first makes the truncating cast exact.


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _cast(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    if INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _dt_block(dt_ptrs, live, dt_bias_ptr, h, dt_min, dt_max, HAS_DT_BIAS: tl.constexpr,
              DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr):
    """dt' = clamp(softplus(dt + dt_bias)) in fp32 on the live tokens, 0 elsewhere."""
    dt = tl.load(dt_ptrs, mask=live, other=0.0)
    bias = tl.load(dt_bias_ptr + h).to(tl.float32) if HAS_DT_BIAS else 0.0
    return _dt_of(dt, live, bias, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT)


@triton.jit
def _dt_of(dt, live, bias, dt_min, dt_max, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
           HAS_DT_LIMIT: tl.constexpr):
    """`_dt_block` on raw dt values already loaded, with the head's bias (a scalar) already read."""
    dt = dt.to(tl.float32)
    if HAS_DT_BIAS:
        dt += bias
    if DT_SOFTPLUS:
        dt = _softplus(dt)
    if HAS_DT_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return tl.where(live, dt, 0.0)


@triton.jit
def _boundary_row(ctx, j, length, chunk_size, bound_chunks):
    """Which boundary state chunk j of a sequence (context ctx, `length` tokens) ends on, counted
    from the sequence's first, or -1. Boundaries are the absolute multiples of
    chunk_size * bound_chunks (the model's chunk) that the sequence crosses; every chunk but
    possibly the last ends on a multiple of chunk_size."""
    ends = ctx // chunk_size + j + 1  # the chunk's end, in chunks, were it whole
    whole = ends * chunk_size <= ctx + length
    on = whole & (ends % bound_chunks == 0)
    return tl.where(on, ends // bound_chunks - ctx // (chunk_size * bound_chunks) - 1, -1)


# NOTE: batch-dependent sizes are not specialized on, so a new batch never recompiles
@triton.jit(do_not_specialize=["S", "K_max", "search_iters"])
def _ssd_chunk_meta_kernel(
    # pointers
    cu_ptr, ctx_ptr,  # [S+1], [S] int32
    chunk_ptr, seq_first_ptr, seq_end_ptr, bcu_ptr,  # [K, 4], [S], [S], [S+1] int32 outputs
    # dimensions
    S, K_max, chunk_size, search_iters,
    bound_chunks,  # chunks between two boundary states (the model's chunk / the kernel's chunk)
    # meta-parameters
    AT_POSITIONS: tl.constexpr,  # chunks at absolute multiples of chunk_size (else from each first token)
    BLOCK: tl.constexpr,
):
    # NOTE: the scan is the same function of its inputs however a sequence is cut into chunks; only
    # boundary states tie the cuts to absolute positions. Without them (AT_POSITIONS off) a sequence
    # is cut from its first token, as if its context were 0: a mid-chunk start then costs no extra
    # partial chunk (and the boundary counts in bcu are those of context 0, never read)
    carry_c = tl.zeros([], dtype=tl.int32)
    carry_b = tl.zeros([], dtype=tl.int32)
    tl.store(bcu_ptr, carry_b)
    for s0 in range(0, S, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        ms = s < S
        c0 = tl.load(cu_ptr + s, mask=ms, other=0)
        length = tl.load(cu_ptr + s + 1, mask=ms, other=0) - c0
        ctx = tl.load(ctx_ptr + s, mask=ms & AT_POSITIONS, other=0)
        nch = tl.where(ms, (ctx % chunk_size + length + chunk_size - 1) // chunk_size, 0)
        bound = chunk_size * bound_chunks
        nb = tl.where(ms, (ctx + length) // bound - ctx // bound, 0)  # boundaries crossed
        end = tl.cumsum(nch, 0) + carry_c
        tl.store(seq_end_ptr + s, end, mask=ms)
        tl.store(seq_first_ptr + s, end - nch, mask=ms)
        tl.store(bcu_ptr + 1 + s, tl.cumsum(nb, 0) + carry_b, mask=ms)
        carry_c += tl.sum(nch, 0)
        carry_b += tl.sum(nb, 0)
    # NOTE: the search below reads seq_end written by other threads of this program
    tl.debug_barrier()
    for k0 in range(0, K_max, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        lo = tl.zeros([BLOCK], dtype=tl.int32)
        hi = lo + S
        for _ in range(search_iters):  # first s with seq_end[s] > k (S when k >= K)
            mid = (lo + hi) // 2
            e = tl.load(seq_end_ptr + mid, mask=mid < S, other=0)
            live = lo < hi
            lo = tl.where(live & (e <= k), mid + 1, lo)
            hi = tl.where(live & (e > k), mid, hi)
        s = lo
        ok = s < S
        first = tl.load(seq_first_ptr + s, mask=ok, other=0)
        c0 = tl.load(cu_ptr + s, mask=ok, other=0)
        c1 = tl.load(cu_ptr + s + 1, mask=ok, other=0)
        ctx = tl.load(ctx_ptr + s, mask=ok & AT_POSITIONS, other=0)
        r = ctx % chunk_size
        b0 = tl.load(bcu_ptr + s, mask=ok, other=0)
        j = k - first  # chunk index inside the sequence
        start = c0 + tl.maximum(j * chunk_size - r, 0)
        stop = tl.minimum(c0 + (j + 1) * chunk_size - r, c1)
        mk = k < K_max
        brow = _boundary_row(ctx, j, c1 - c0, chunk_size, bound_chunks)
        tl.store(chunk_ptr + 4 * k, s, mask=mk)
        tl.store(chunk_ptr + 4 * k + 1, tl.where(ok, start, 0), mask=mk)
        tl.store(chunk_ptr + 4 * k + 2, tl.where(ok, stop - start, 0), mask=mk)
        tl.store(chunk_ptr + 4 * k + 3, tl.where(ok & (brow >= 0), b0 + brow, -1), mask=mk)


@triton.jit
def _chunk_dt_pass(dt_ptr, dt_bias_ptr, dt_buf_ptr, cs_buf_ptr, t0, L, h, A_h, buf, dt_min, dt_max, stride_dt_t,
                   stride_dt_h, CHUNK: tl.constexpr, CHUNK_PAD: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                   DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr):
    """The whole chunk at once: dt' (0 past L) and its running sum of dt' * A (flat past L, so
    cs[CHUNK-1] is the chunk's total), stored to dt_buf and cs_buf; returns the total."""
    tok = tl.arange(0, CHUNK_PAD)
    live = tok < L
    dt_base = dt_ptr + t0 * stride_dt_t + h * stride_dt_h
    dt_c = _dt_block(dt_base + tok * stride_dt_t, live, dt_bias_ptr, h, dt_min, dt_max, HAS_DT_BIAS,
                     DT_SOFTPLUS, HAS_DT_LIMIT)
    cs_c = tl.cumsum(dt_c * A_h, 0)
    tl.store(dt_buf_ptr + buf + tok, dt_c, mask=tok < CHUNK)
    tl.store(cs_buf_ptr + buf + tok, cs_c, mask=tok < CHUNK)
    return tl.sum(tl.where(tok == CHUNK_PAD - 1, cs_c, 0.0), 0)  # exactly cs[CHUNK-1]


@triton.jit(do_not_specialize=["K_max"])
def _ssd_chunk_dt_kernel(
    dt_ptr, A_ptr, dt_bias_ptr, chunk_ptr,  # inputs
    dt_buf_ptr, cs_buf_ptr,  # outputs
    K_max, dt_min, dt_max, stride_dt_t, stride_dt_h,
    CHUNK: tl.constexpr, CHUNK_PAD: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr,
):
    # one (head, chunk): the chunk-state kernel's first pass as a launch of its own, so that kernel's
    # programs start on their x and B tiles at once instead of behind a dependent load-scan-store
    h = tl.program_id(0)
    k = tl.program_id(1).to(tl.int64)
    t0 = tl.load(chunk_ptr + 4 * k + 1).to(tl.int64)
    L = tl.load(chunk_ptr + 4 * k + 2)
    if L == 0:  # past the last logical chunk
        return
    _chunk_dt_pass(dt_ptr, dt_bias_ptr, dt_buf_ptr, cs_buf_ptr, t0, L, h, tl.load(A_ptr + h), (h * K_max + k) * CHUNK,
                   dt_min, dt_max, stride_dt_t, stride_dt_h, CHUNK, CHUNK_PAD, HAS_DT_BIAS, DT_SOFTPLUS,
                   HAS_DT_LIMIT)


@triton.jit(do_not_specialize=["K_max"])
def _ssd_chunk_state_kernel(
    # pointers
    x_ptr, dt_ptr, A_ptr, dt_bias_ptr, B_ptr, chunk_ptr,  # inputs
    dt_buf_ptr, cs_buf_ptr, states_ptr,  # outputs
    x_desc, B_desc,  # when TMA: x as [T, H * P], B as [T, G * N] (else unused)
    # dimensions
    K_max, nheads, headdim, dstate, heads_per_group, dt_min, dt_max,
    # strides (token, head / group); the last axes have stride 1
    stride_x_t, stride_x_h, stride_dt_t, stride_dt_h, stride_B_t, stride_B_g,
    # meta-parameters
    CHUNK: tl.constexpr, CHUNK_PAD: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr, REREAD: tl.constexpr, TMA: tl.constexpr,
    DT_DONE: tl.constexpr,  # dt_buf and cs_buf already hold this chunk's dt' and cs (REREAD with it)
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    h = tl.program_id(0)
    k = tl.program_id(1).to(tl.int64)
    t0 = tl.load(chunk_ptr + 4 * k + 1).to(tl.int64)
    L = tl.load(chunk_ptr + 4 * k + 2)
    if L == 0:  # past the last logical chunk (the grid is sized by an upper bound)
        return
    A_h = tl.load(A_ptr + h)
    buf = (h * K_max + k) * CHUNK

    if DT_DONE:
        total = tl.load(cs_buf_ptr + buf + CHUNK - 1)  # cs is flat past L
    else:
        # pass 1 (every program along axis 2 stores the same values)
        total = _chunk_dt_pass(dt_ptr, dt_bias_ptr, dt_buf_ptr, cs_buf_ptr, t0, L, h, A_h, buf, dt_min, dt_max,
                               stride_dt_t, stride_dt_h, CHUNK, CHUNK_PAD, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT)
        if REREAD:
            # NOTE: pass 2 reads back blocks of what other threads of this program just stored
            tl.debug_barrier()
    dt_base = dt_ptr + t0 * stride_dt_t + h * stride_dt_h  # pass 2's recomputation (not REREAD)

    # pass 2: state[p, n] = sum_s x[s, p] dt'[s] exp(cs_total - cs[s]) B[s, n]
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_base = x_ptr + t0 * stride_x_t + h * stride_x_h
    B_base = B_ptr + t0 * stride_B_t + (h // heads_per_group) * stride_B_g
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    carry = tl.zeros([], dtype=tl.float32)
    for j in range(0, L, BLOCK_K):
        pos = j + tl.arange(0, BLOCK_K)
        m = pos < L
        if REREAD:
            dt = tl.load(dt_buf_ptr + buf + pos, mask=m, other=0.0, cache_modifier=".cg")
            cs = tl.load(cs_buf_ptr + buf + pos, mask=m, other=0.0, cache_modifier=".cg")
        else:  # recomputed: same dt', cs up to rounding (blockwise running sum)
            dt = _dt_block(dt_base + pos * stride_dt_t, m, dt_bias_ptr, h, dt_min, dt_max, HAS_DT_BIAS,
                           DT_SOFTPLUS, HAS_DT_LIMIT)
            cs = tl.cumsum(dt * A_h, 0) + carry
            carry = tl.sum(tl.where(tl.arange(0, BLOCK_K) == BLOCK_K - 1, cs, 0.0), 0)
        w = dt * tl.exp(total - cs)  # [BLOCK_K], 0 past L
        if TMA:
            # NOTE: whole tiles, zero past the last token; the tokens past L (the next sequence's)
            # get w = 0, so they add nothing (the launcher checks the tiles are P and N wide)
            row = (t0 + j).to(tl.int32)
            xT = tl.trans(x_desc.load([row, h * headdim]))  # [BLOCK_P, BLOCK_K]
            Bk = B_desc.load([row, (h // heads_per_group) * dstate + tl.program_id(2) * BLOCK_N])
        else:
            xT = tl.load(x_base + offs_p[:, None] + pos[None, :] * stride_x_t,
                         mask=(offs_p[:, None] < headdim) & m[None, :], other=0.0)  # [BLOCK_P, BLOCK_K]
            Bk = tl.load(B_base + pos[:, None] * stride_B_t + offs_n[None, :],
                         mask=m[:, None] & (offs_n[None, :] < dstate), other=0.0)  # [BLOCK_K, BLOCK_N]
        xw = _cast(xT.to(tl.float32) * w[None, :], DOT_DTYPE, INTERPRETED)
        acc = _dot(xw, _cast(Bk, DOT_DTYPE, INTERPRETED), acc, DOT_PRECISION, INTERPRETED)
    row = (k * nheads + h) * (headdim * dstate)
    tl.store(states_ptr + row + offs_p[:, None] * dstate + offs_n[None, :],
             _cast(acc, states_ptr.dtype.element_ty, INTERPRETED), mask=(offs_p[:, None] < headdim) & (offs_n[None, :] < dstate))


@triton.jit(do_not_specialize=["K_max"])
def _ssd_state_passing_kernel(
    # pointers
    states_ptr, cs_buf_ptr, chunk_ptr, seq_first_ptr, seq_end_ptr, state_idx_ptr, has_init_ptr,
    starts_ptr, pool_ptr, bstates_ptr,  # outputs (pool in place)
    # dimensions
    K_max, nheads, PN,
    # meta-parameters
    CHUNK: tl.constexpr, RETURN_BOUNDARY: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """PDL (the scan overlapping it, ssd_config.scan_overlap): the chunk states (the launch just before
    this one's output) are read after the gate; the gate also releases the scan (pdl.py)."""
    s = tl.program_id(1)
    h = tl.program_id(2)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < PN
    first = tl.load(seq_first_ptr + s).to(tl.int64)
    end = tl.load(seq_end_ptr + s).to(tl.int64)
    slot = tl.load(state_idx_ptr + s).to(tl.int64)
    has_init = tl.load(has_init_ptr + s)
    pool_ptrs = pool_ptr + (slot * nheads + h) * PN + offs
    state = tl.load(pool_ptrs, mask=m & has_init, other=0.0).to(tl.float32)
    pdl_gate(PDL)

    # one chunk ahead: the loads of chunk c+1 are in flight while chunk c is folded in
    cst = tl.load(states_ptr + (first * nheads + h) * PN + offs, mask=m, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(cs_buf_ptr + (h * K_max + first) * CHUNK + CHUNK - 1))
    for c in range(first, end):
        nxt = c + 1 < end
        cst_n = tl.load(states_ptr + ((c + 1) * nheads + h) * PN + offs, mask=m & nxt, other=0.0).to(tl.float32)
        decay_n = tl.exp(tl.load(cs_buf_ptr + (h * K_max + c + 1) * CHUNK + CHUNK - 1, mask=nxt, other=0.0))
        tl.store(starts_ptr + (c * nheads + h) * PN + offs, _cast(state, starts_ptr.dtype.element_ty, INTERPRETED), mask=m)
        state = decay * state + cst
        if RETURN_BOUNDARY:
            brow = tl.load(chunk_ptr + 4 * c + 3).to(tl.int64)
            tl.store(bstates_ptr + (brow * nheads + h) * PN + offs, state, mask=m & (brow >= 0))
        cst = cst_n
        decay = decay_n
    tl.store(pool_ptrs, _cast(state, pool_ptr.dtype.element_ty, INTERPRETED), mask=m)
