"""SSDConfig: block shapes, warps and switches of the Triton SSD scan's kernels (ssd_triton.py),
with the defaults per dot dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SSDConfig:
    """Block shapes and warps of the three heavy kernels.

    Defaults (bf16 / fp16): the fastest of the sweeps in benchmarks/ssd_gpu.py and ssd_sweep_gpu.py on
    an H200, Mamba2-2.7B shapes (benchmarks/NOTES_ssd.md); `default_config` picks per batch.
    """

    state_block_k: int = 32  # tokens per dot in the chunk-state kernel
    state_block_n: int = 256  # dstate columns per program (fewer: more programs, same dt' work)
    state_reread: bool = True  # re-read dt' and its cumsum from scratch (else recompute them)
    state_warps: int = 4
    state_stages: int = 4
    # dt' and its cumsum by a launch of their own before the chunk-state kernel (two-kernel path),
    # whose programs then start on their x and B tiles at once instead of behind a dependent dt
    # load-scan-store: at 1 x 32768 that kernel 258 -> 208 us, plus 20 us for the dt launch (H200,
    # session 16). One launch more of host time: large batches only (LARGE_BATCH_TOKENS)
    state_dt_launch: bool = False
    scan_block_m: int = 64  # output rows per program
    scan_block_k: int = 32  # tokens per step of the causal loop
    scan_heads: int = 1  # heads per program sharing C B^T (1, 2, 4; 1 where it does not divide H / G)
    scan_warps: int = 4
    scan_stages: int = 3
    pass_block: int = 512  # state elements (of headdim * dstate) per program
    pass_warps: int = 4
    # C B^T of each (chunk, group): "fused" = made per head inside the scan kernel; "fp32" / "low" =
    # made once by a fifth launch into a [K, G, Q, Q] tensor in fp32 / the dot dtype, then loaded
    scan_cb: str = "fused"
    # with C B^T loaded in whole tiles and one head a program: the next step's C B^T tile, cs and dt'
    # loaded into registers one step ahead by the kernel itself (Triton's pipeliner, at two stages,
    # gives each one shared buffer and waits out its latency at every step's top): the scan kernel
    # 752 -> 700 us at 1 x 32768, 292 -> 269 us at 16 x 1024 (H200, session 16)
    scan_prefetch: bool = False
    scan_head_loop: int = 1  # sets of scan_heads heads run one after the other by one scan program
    # the scan launched under PDL (pdl.py) while the passing kernel runs: each program computes its
    # causal part first (C B^T, cs and dt' come from launches two or more back), then waits for the
    # passing kernel and adds the entering state's part. Two-kernel path with the look-ahead only
    # (scan_prefetch, dt' launch, C B^T loaded); without PDL (CPU, PD_SSM_PDL=0) the same order, no
    # overlap. H200, 2.7B shapes, one run (RESULTS.md session 24): 1 x 8192 0.304 -> 0.298 ms, 1 x 32768
    # 1.094 -> 1.085: only the scan's first wave overlaps (its programs then hold their SM at the gate)
    scan_overlap: bool = False
    chunk_states_low: bool = False  # chunk end states (state -> passing kernel) in the dot dtype
    # register cap of the scan kernel (ptxas .maxnreg): 128 at 4 warps keeps 4 programs per SM
    scan_maxnreg: int | None = None
    cb_block: int = 64  # rows and columns of C B^T per program of the CB kernel
    cb_warps: int = 4
    # the scan's C, B and x tiles through TMA descriptors (no per-element addresses or masks) where
    # the layout allows it (`ssd_triton._tma_readable`) and the batch has at least scan_tma_min_tokens
    # tokens; else the pointer loads. 2-6% faster at 1x32768, 16x1024 and 1x8192 on the H200, same
    # results; but the descriptors cost the host ~40 us a launch, which a short eager scan (1x2048:
    # 0.14 -> 0.18 ms) does not hide (benchmarks/RESULTS.md, session 11; measured before the
    # launcher kept plans per signature and built descriptors without their checks, session 17)
    scan_tma: bool = True
    scan_tma_min_tokens: int = 4096
    state_tma: bool = True  # the same for the chunk-state kernel's x and B tiles (same threshold): 1-3% more
    # chunk states and state passing in one launch, one program per (head, sequence, dstate block)
    # walking the sequence's chunks (ssd_triton_serial.py): no fp32 chunk-state round trip, one launch
    # less, but only H * S * N / serial_block_n programs, each as long as its sequence. Used where the
    # longest sequence has at most serial_max_tokens (ssd_plan.use_serial_states). H200, 2.7B
    # shapes (benchmarks/RESULTS.md, session 13), against the two kernels: 4-15% faster at 8 x 1024 to
    # 64 x 128 tokens, level at 2 x 4096 and 4 x 2048, 1.4x slower at 1 x 8192 and 1.3x at
    # 7680 + 512. Its x and B tiles go through TMA descriptors under scan_tma's conditions
    state_serial: bool = True
    serial_max_tokens: int = 1024
    # the serial path's chunk where it divides the model's (ssd_plan.kernel_chunk): 12% faster at 16 x
    # 1024 tokens than the model's 256 (H200, benchmarks/RESULTS.md, session 14)
    serial_chunk: int = 128
    serial_block_n: int = 64  # dstate columns per serial program
    serial_block_k: int = 64  # tokens a step of the serial program (a power of two dividing the chunk)
    serial_warps: int = 4
    serial_stages: int = 3

    def __post_init__(self) -> None:
        if self.scan_cb not in ("fused", "fp32", "low"):
            raise ValueError(f"SSDConfig.scan_cb must be 'fused', 'fp32' or 'low', not {self.scan_cb!r}")
        if self.serial_chunk < 1:
            raise ValueError(f"SSDConfig.serial_chunk must be >= 1, not {self.serial_chunk}")
        if self.scan_heads not in (1, 2, 4) or self.scan_head_loop < 1:
            raise ValueError(f"SSDConfig: scan_heads must be 1, 2 or 4 and scan_head_loop >= 1 "
                             f"(got {self.scan_heads}, {self.scan_head_loop})")


# NOTE: fp32 dots are IEEE (FMA, no tensor cores) and hold larger tiles in registers: smaller
# tiles and more warps keep them from spilling (ptxas, sm_90)
_FP32_CONFIG = SSDConfig(state_block_k=64, state_warps=8, state_stages=2, scan_block_m=64, scan_block_k=32,
                         scan_heads=1, scan_warps=8, scan_stages=2, scan_tma=False,
                         state_tma=False, state_serial=False)  # TMA, serial: not measured in fp32


# NOTE: from LARGE_BATCH_TOKENS tokens (bf16 / fp16), C B^T is made once per (chunk, group) by its
# own launch in fp32 and loaded by the scan, whose programs at two stages and <= 128 registers take
# 56 KB of shared memory: four an SM, not three. The same rounding as the fused scan, 5-6% less
# device time at 1 x 8192, 16 x 1024 and 1 x 32768 (1% at 1 x 2048; H200, 2.7B shapes, RESULTS.md
# session 14); with its tiles fetched a step ahead and dt' by its own launch, 1 x 32768 1.16 -> 1.08 ms
# and 16 x 1024 0.483 -> 0.462 ms more (session 16). But two launches more, whose host time eager
# calls of fewer tokens do not hide: with plans kept per signature (session 17), eager 1 x 8192
# 0.332 -> 0.299 ms, but 1 x 4096 0.241 -> 0.279 ms (host-bound), so smaller batches keep the fused scan
LARGE_BATCH_TOKENS = 8192
_LARGE_BATCH_CONFIG = SSDConfig(scan_cb="fp32", scan_stages=2, scan_maxnreg=128, scan_prefetch=True,
                                state_dt_launch=True, scan_overlap=True)


def default_config(dot_dtype: torch.dtype, num_tokens: int = 0) -> SSDConfig:
    """The config a launch without an explicit one runs: by the dots' dtype and the batch's tokens."""
    if dot_dtype == torch.float32:
        return _FP32_CONFIG
    return _LARGE_BATCH_CONFIG if num_tokens >= LARGE_BATCH_TOKENS else SSDConfig()
