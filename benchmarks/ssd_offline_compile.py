"""Registers, shared memory and programs per SM of the SSD scan kernel's and the serial state
kernel's configs, without a GPU.

Triton compiles for sm_90 on any machine (its wheel carries ptxas and cuobjdump): this compiles
`_ssd_chunk_scan_kernel` and `_ssd_state_serial_kernel` (both with TMA tiles, the bf16 default) at Mamba2-2.7B shapes (bf16,
chunk 256, headdim 64, dstate 128) for each config, reads the shared memory from Triton's metadata and the registers from `cuobjdump
-res-usage`, and estimates how many programs fit on one H100 / H200 SM (228 KB of shared memory
with 1 KB reserved per program, 64 K registers). ncu on the H200 (RESULTS.md, session 5) found the
default config limited to 3 programs (12 warps) per SM by its 70 KB of shared memory, and the
kernel bound by issue and latency: configs that fit more programs are the ones worth timing.

    python benchmarks/ssd_offline_compile.py        # a table: config, registers, shared KB, programs / SM

No device time; ~10 s a config on a laptop-class CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pd_ssm.kernels.ssd_triton_scan import _ssd_chunk_scan_kernel  # noqa: E402
from pd_ssm.kernels.ssd_triton_serial import _ssd_state_serial_kernel  # noqa: E402

SMEM_PER_SM = 233_472  # bytes a program's shared memory may come from (ncu: 233.47 KB configured)
SMEM_RESERVED = 1024  # per program, by the driver
REGS_PER_SM = 65_536
_PTRS = dict(x_ptr="*bf16", B_ptr="*bf16", C_ptr="*bf16", D_ptr="*fp32", dt_buf_ptr="*fp32", cs_buf_ptr="*fp32",
             starts_ptr="*bf16", chunk_ptr="*i32", cb_ptr="*bf16", out_ptr="*bf16")
# name: (overrides of the bf16 default: BM, BK, warps, stages, C B^T loaded, register cap, look-ahead)
CONFIGS: dict[str, dict[str, Any]] = {
    "default (BM64 BK32 w4 s3)": {},
    "s2": dict(stages=2),
    "BK16 s3": dict(BK=16),
    "BK16 s2": dict(BK=16, stages=2),
    "BK64 s2": dict(BK=64, stages=2),
    "cb_low s3": dict(cb=True),
    "cb_low s2": dict(cb=True, stages=2),
    "cb_low s2 r128": dict(cb=True, stages=2, maxnreg=128),
    "cb_low s2 r128 prefetch": dict(cb=True, stages=2, maxnreg=128, prefetch=True),
    "cb_low BK16 s3": dict(cb=True, BK=16),
}


_SERIAL_ARGS = dict(x_ptr="*bf16", dt_ptr="*bf16", A_ptr="*fp32", dt_bias_ptr="*fp32", B_ptr="*bf16", cu_ptr="*i32",
                    ctx_ptr="*i32", seq_first_ptr="*i32", bcu_ptr="*i32", state_idx_ptr="*i32", has_init_ptr="*i1",
                    dt_buf_ptr="*fp32", cs_buf_ptr="*fp32", starts_ptr="*bf16", pool_ptr="*fp32",
                    bstates_ptr="*fp32", dt_min="fp32", dt_max="fp32")
# name: (overrides of SSDConfig's serial defaults: tokens a step, dstate columns, warps, stages)
SERIAL_CONFIGS: dict[str, dict[str, Any]] = {
    "BK64 BN128 w4 s3 (default)": {},
    "BK64 BN64": dict(BN=64),
    "BK32 s4": dict(BK=32, stages=4),
    "BK64 w8": dict(warps=8),
    "BK128 w8 s2": dict(BK=128, warps=8, stages=2),
    "whole chunks: BK256 w8 s2": dict(BK=256, warps=8, stages=2),
}


def compile_scan(BM: int = 64, BK: int = 32, warps: int = 4, stages: int = 3, cb: bool = False,
                 maxnreg: int | None = None, prefetch: bool = False, late_start: bool = False) -> tuple[int, int]:
    """(registers per thread, shared bytes per program) of one scan config, compiled for sm_90."""
    const = dict(CHUNK=256, HAS_D=True, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", INTERPRETED=False, HEADS=1,
                 HEAD_LOOP=1, CB_LOADED=cb, CB_WHOLE_TILES=cb, TMA=True, PREFETCH=prefetch, LATE_START=late_start,
                 PDL=late_start, BLOCK_M=BM, BLOCK_K=BK, BLOCK_P=64, BLOCK_N=128)
    descs = dict(x_desc=f"tensordesc<bf16[{BK},64]>", B_desc=f"tensordesc<bf16[{BK},128]>",
                 C_desc=f"tensordesc<bf16[{BM},128]>")
    sig = {n: "constexpr" if n in const else descs.get(n, _PTRS.get(n, "i32"))
           for n in _ssd_chunk_scan_kernel.arg_names}
    return _compile(_ssd_chunk_scan_kernel, sig, const, warps, stages, maxnreg)


def compile_serial(BK: int = 64, BN: int = 128, warps: int = 4, stages: int = 3) -> tuple[int, int]:
    """(registers per thread, shared bytes per program) of one serial state config, TMA tiles."""
    const = dict(CHUNK=256, CHUNK_PAD=256, HAS_DT_BIAS=True, DT_SOFTPLUS=True, HAS_DT_LIMIT=False,
                 DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", INTERPRETED=False, TMA=True, RETURN_BOUNDARY=False,
                 STEP=BK, BLOCK_K=BK, BLOCK_P=64, BLOCK_N=BN)
    descs = dict(x_desc=f"tensordesc<bf16[{BK},64]>", B_desc=f"tensordesc<bf16[{BK},{BN}]>")
    sig = {n: "constexpr" if n in const else descs.get(n, _SERIAL_ARGS.get(n, "i32"))
           for n in _ssd_state_serial_kernel.arg_names}
    return _compile(_ssd_state_serial_kernel, sig, const, warps, stages, None)


def _compile(fn: Any, sig: dict[str, str], const: dict[str, Any], warps: int, stages: int,
             maxnreg: int | None) -> tuple[int, int]:
    # as a real launch specializes them: 16-byte aligned pointers, strides and head sizes % 16 == 0
    aligned = [(i,) for i, n in enumerate(fn.arg_names)
               if sig[n].startswith("*") or n.startswith("stride") or n in ("headdim", "dstate")]
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs={a: [["tt.divisibility", 16]] for a in aligned})
    options: dict[str, Any] = dict(num_warps=warps, num_stages=stages)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = int(usage.split("REG:")[1].split()[0])
    return regs, int(k.metadata.shared)


def programs_per_sm(regs: int, smem: int, warps: int) -> int:
    by_smem = SMEM_PER_SM // (smem + SMEM_RESERVED)
    by_regs = REGS_PER_SM // (-(-regs // 8) * 8 * 32 * warps)  # registers are allocated 8 per thread at a time
    return min(by_smem, by_regs, 32)


def main() -> None:
    for title, configs, fn in (("scan", CONFIGS, compile_scan), ("serial state", SERIAL_CONFIGS, compile_serial)):
        print(f"{title + ' config':28s} {'regs':>5s} {'shared KB':>10s} {'programs/SM':>12s}")
        for name, over in configs.items():
            regs, smem = fn(**over)
            n = programs_per_sm(regs, smem, over.get("warps", 4))
            print(f"{name:28s} {regs:5d} {smem / 1024:10.1f} {n:12d}", flush=True)


if __name__ == "__main__":
    main()
