"""Where the SSD chunk-scan kernel's time goes: the kernel with parts taken out, timed alone.

A copy of `_ssd_chunk_scan_kernel` (one head per program, C B^T made in the kernel, the engine's
default) whose constexpr switches drop one part each: the entering state's dot, the C B^T dot and
its B loads, the decay's exp, the x loads, the weights' dot with x. The outputs of the ablated
kernels are wrong by design; only their times mean something: the part whose removal saves the most
is what bounds the kernel. Mamba2-2.7B shapes, one sequence of T tokens (default 32768), scratch
buffers (dt', its cumsum, entering states, chunk metadata) filled with random values of the right
ranges; do_bench median inside a CUDA graph-free eager launch.

    PYTHONPATH=. python3 benchmarks/ssd_scan_ablation_gpu.py [--tokens 32768]
    PYTHONPATH=. ncu --clock-control none -k regex:_ssd_chunk_scan --launch-skip 2 --launch-count 1 \
        --section WarpStateStats ... python3 benchmarks/ssd_scan_ablation_gpu.py --profile

Prints one line per variant (ms, and the share of the full kernel's time it removes) and writes
$OUT/ssd_scan_ablation.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from pd_ssm.kernels.ssd_triton_kernels import _cast, _dot
from pd_ssm.kernels.ssd_triton_scan import _ssd_chunk_scan_kernel


@triton.jit
def _scan_ablated(
    x_ptr, B_ptr, C_ptr, D_ptr, dt_buf_ptr, cs_buf_ptr, starts_ptr, chunk_ptr, out_ptr,
    K_max, nheads, headdim, dstate,
    stride_x_t, stride_x_h, stride_B_t, stride_C_t, stride_o_t, stride_o_h,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, NO_START: tl.constexpr, NO_CB: tl.constexpr, NO_EXP: tl.constexpr,
    NO_X: tl.constexpr, NO_PV: tl.constexpr, NO_LOOP: tl.constexpr,
):
    h = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    k = tl.program_id(2).to(tl.int64)
    t0 = tl.load(chunk_ptr + 4 * k + 1).to(tl.int64)
    L = tl.load(chunk_ptr + 4 * k + 2)
    if mb * BLOCK_M >= L:
        return
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mm = offs_m < L
    C_m = tl.load(C_ptr + (t0 + offs_m[:, None]) * stride_C_t + offs_n[None, :], mask=mm[:, None], other=0.0)
    buf = (h * K_max + k) * CHUNK
    cs_m = tl.load(cs_buf_ptr + buf + offs_m)
    D_h = tl.load(D_ptr + h)
    x_base = x_ptr + t0 * stride_x_t + h * stride_x_h
    if NO_START:
        acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    else:
        stT = tl.load(starts_ptr + (k * nheads + h) * (headdim * dstate) + offs_p[None, :] * dstate + offs_n[:, None])
        acc = _dot(C_m, stT, None, "tf32", False) * tl.exp(cs_m)[:, None]
    hi = tl.minimum((mb + 1) * BLOCK_M, L)
    if NO_LOOP:
        hi = 0
    for kb in range(0, hi, BLOCK_K):
        offs_k = kb + tl.arange(0, BLOCK_K)
        mk = offs_k < L
        causal = offs_m[:, None] >= offs_k[None, :]
        diag = offs_m[:, None] == offs_k[None, :]
        if NO_CB:
            cb = tl.where(causal, 1.0, 0.0)
        else:
            BT = tl.load(B_ptr + (t0 + offs_k[None, :]) * stride_B_t + offs_n[:, None], mask=mk[None, :], other=0.0)
            cb = _dot(C_m, BT, None, "tf32", False)
        cs_k = tl.load(cs_buf_ptr + buf + offs_k, mask=mk, other=0.0)
        dt_k = tl.load(dt_buf_ptr + buf + offs_k, mask=mk, other=0.0)
        if NO_EXP:
            decay = tl.where(causal, cs_m[:, None] - cs_k[None, :], 0.0)
        else:
            decay = tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf")))
        w = _cast(cb * decay * dt_k[None, :] + tl.where(diag, D_h, 0.0), tl.bfloat16, False)
        if NO_X:
            xk = tl.full([BLOCK_K, BLOCK_P], 1.0, tl.bfloat16)
        else:
            xk = tl.load(x_base + offs_k[:, None] * stride_x_t + offs_p[None, :], mask=mk[:, None], other=0.0)
        if NO_PV:
            acc += tl.sum(w.to(tl.float32), 1)[:, None] * tl.sum(xk.to(tl.float32), 0)[None, :]
        else:
            acc = _dot(w, xk, acc, "tf32", False)
    tl.store(out_ptr + (t0 + offs_m[:, None]) * stride_o_t + h * stride_o_h + offs_p[None, :],
             acc.to(tl.bfloat16), mask=mm[:, None])


VARIANTS = {
    "full": {},
    "no entering-state dot": dict(NO_START=True),
    "no C B^T dot (no B loads)": dict(NO_CB=True),
    "no exp": dict(NO_EXP=True),
    "no x loads": dict(NO_X=True),
    "no weights-x dot": dict(NO_PV=True),
    "no causal loop": dict(NO_LOOP=True),
    "loop of elementwise only": dict(NO_CB=True, NO_X=True, NO_PV=True),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--profile", action="store_true",
                    help="only launch the product kernel 4 times (under ncu: --launch-skip 2 --launch-count 1)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    T, H, P, N, Q = a.tokens, 80, 64, 128, 256
    K = T // Q
    g = torch.Generator(device=dev).manual_seed(0)
    sets = []
    for _ in range(3):  # rotate past L2
        x = torch.randn(T, H, P, device=dev, generator=g).bfloat16()
        BC = torch.randn(T, 2, N, device=dev, generator=g).bfloat16()
        dt = torch.rand(H, K, Q, device=dev, generator=g) * 0.1
        cs = torch.cumsum(-dt * 0.5, -1).contiguous()
        starts = torch.randn(K, H, P * N, device=dev, generator=g).bfloat16()
        out = torch.empty(T, H, P, device=dev, dtype=torch.bfloat16)
        sets.append((x, BC, dt, cs, starts, out))
    info = torch.zeros(K, 4, dtype=torch.int32, device=dev)
    info[:, 1] = torch.arange(K, device=dev, dtype=torch.int32) * Q
    info[:, 2] = Q
    info[:, 3] = -1
    D = torch.rand(H, device=dev, generator=g)
    BM, BK = 64, 32
    grid = (H, Q // BM, K)

    def stock(s):  # the product kernel at the engine's default config
        x, BC, dt, cs, starts, out = s
        B, C = BC[:, 0:1], BC[:, 1:2]
        return _ssd_chunk_scan_kernel[grid](
            x, B, C, D, dt, cs, starts, info, out, out, K, H, P, N, H, 1,
            x.stride(0), x.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1), out.stride(0), out.stride(1),
            CHUNK=Q, HAS_D=True, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", INTERPRETED=False, HEADS=1,
            HEAD_LOOP=1, CB_LOADED=False, CB_WHOLE_TILES=False, BLOCK_M=BM, BLOCK_K=BK, BLOCK_P=P, BLOCK_N=N,
            num_warps=4, num_stages=3,
        )

    def ablated(s, flags):
        x, BC, dt, cs, starts, out = s
        B, C = BC[:, 0], BC[:, 1]
        kw = dict(NO_START=False, NO_CB=False, NO_EXP=False, NO_X=False, NO_PV=False, NO_LOOP=False)
        kw.update(flags)
        return _scan_ablated[grid](
            x, B, C, D, dt, cs, starts, info, out, K, H, P, N,
            x.stride(0), x.stride(1), B.stride(0), C.stride(0), out.stride(0), out.stride(1),
            CHUNK=Q, BLOCK_M=BM, BLOCK_K=BK, BLOCK_P=P, BLOCK_N=N, num_warps=4, num_stages=3, **kw,
        )

    def time_of(fn) -> float:
        i = [0]

        def step() -> None:
            fn(sets[i[0] % len(sets)])
            i[0] += 1

        return do_bench(step, warmup=20, rep=100, return_mode="median")

    if a.profile:
        for k in range(4):
            stock(sets[k % len(sets)])
        torch.cuda.synchronize()
        return
    res = {"stock kernel": time_of(stock)}
    regs = {"stock kernel": getattr(stock(sets[0]), "n_regs", -1)}
    for name, flags in VARIANTS.items():
        res[name] = time_of(lambda s, f=flags: ablated(s, f))
        regs[name] = getattr(ablated(sets[0], flags), "n_regs", -1)
    full = res["full"]
    for name, ms in res.items():
        print(f"{name:32s} {ms:7.3f} ms  removes {100 * (1 - ms / full):5.1f}% of 'full'  ({regs[name]} registers)",
              flush=True)
    os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
    json.dump(dict(tokens=T, ms=res, registers=regs), open(os.path.join(os.environ.get("OUT", "/tmp/out"), "ssd_scan_ablation.json"), "w"),
              indent=1)


if __name__ == "__main__":
    main()
