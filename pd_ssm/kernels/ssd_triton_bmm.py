"""C·B^T per (logical chunk, group) for the varlen SSD scan (optional launch; see ssd_triton.py).

All heads of a group share B and C, so the chunk scan's causal weights C_l·B_s are the same for
each of the H / G heads. Made here once per (chunk, group) and read by the scan kernel, instead of
recomputed by every head's program (at Mamba2-2.7B shapes, 80 heads on one group: about half of
the scan's FLOPs).

Layout: cb [K_max, G, CHUNK, CHUNK], rows = target token l, columns = source token s, both
relative to the chunk start. Only blocks that hold some s <= l < L are written, and those whole
(columns past L as zeros, entries above the diagonal finite). The scan reads whole tiles of such
blocks where its tiling nests in them (unmasked columns keep its loads vectorized), else it masks
its loads to s <= l < L; the rest is never read (and may hold garbage).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pd_ssm.kernels.ssd_triton_kernels import _cast, _dot


@triton.jit(do_not_specialize=["K_max"])
def _ssd_chunk_cb_kernel(
    # pointers
    C_ptr, B_ptr, chunk_ptr,  # inputs: [T, G, N], [T, G, N], chunk_info [K, 4]
    cb_ptr,  # output: [K_max, G, CHUNK, CHUNK] (fp32 or the dot dtype)
    # dimensions
    K_max, ngroups, dstate,
    # strides (token, group); the last axes have stride 1
    stride_C_t, stride_C_g, stride_B_t, stride_B_g,
    # meta-parameters
    CHUNK: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bm = tl.program_id(0)
    bs = tl.program_id(1)
    kg = tl.program_id(2).to(tl.int64)
    k = kg // ngroups
    g = kg % ngroups
    t0 = tl.load(chunk_ptr + 4 * k + 1).to(tl.int64)
    L = tl.load(chunk_ptr + 4 * k + 2)
    # NOTE: blocks strictly above the diagonal, or past the chunk's length, are never read
    if (bm * BLOCK >= L) | (bs > bm):
        return
    offs_m = bm * BLOCK + tl.arange(0, BLOCK)
    offs_s = bs * BLOCK + tl.arange(0, BLOCK)
    mm = offs_m < L
    ms = offs_s < L
    C_base = C_ptr + t0 * stride_C_t + g * stride_C_g
    B_base = B_ptr + t0 * stride_B_t + g * stride_B_g
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for n0 in range(0, dstate, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mn = offs_n < dstate
        Cm = tl.load(C_base + offs_m[:, None] * stride_C_t + offs_n[None, :], mask=mm[:, None] & mn[None, :],
                     other=0.0)  # [BLOCK, BLOCK_N]
        BT = tl.load(B_base + offs_s[None, :] * stride_B_t + offs_n[:, None], mask=mn[:, None] & ms[None, :],
                     other=0.0)  # [BLOCK_N, BLOCK]
        acc = _dot(_cast(Cm, DOT_DTYPE, INTERPRETED), _cast(BT, DOT_DTYPE, INTERPRETED), acc, DOT_PRECISION,
                   INTERPRETED)
    # NOTE: CHUNK need not be a multiple of BLOCK: rows / columns past CHUNK are masked off
    dst = cb_ptr + kg * (CHUNK * CHUNK) + offs_m[:, None] * CHUNK + offs_s[None, :]
    tl.store(dst, _cast(acc, cb_ptr.dtype.element_ty, INTERPRETED),
             mask=(offs_m[:, None] < CHUNK) & (offs_s[None, :] < CHUNK))
