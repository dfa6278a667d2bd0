"""Correctness at real shapes and timings of the small Triton kernels, in one GPU run.

Kernels: causal conv1d (varlen, update), selective state update (SSU), RMSNorm (plain, gated),
paged KV write, paged decode attention, varlen prefill attention. Shapes: Mamba2-2.7B (conv_dim
5376 = 5120 + 2 * 128, width 4; nheads 80, headdim 64, dstate 128, ngroups 1, fp32 state) and a
hybrid attention layer (32 heads, 8 kv heads, head_dim 128, block 16).

Every figure is a ratio measured in this run: achieved GB/s against a device copy, and for SSU
the time of mamba_ssm's `selective_state_update` (if importable) over ours. Timings are
`triton.testing.do_bench(return_mode="median")` over inputs rotated through sets larger than L2.

    python benchmarks/small_kernels_gpu.py            # results under $OUT (default ./out)
    PYTHONPATH=third_party/baseline:/tmp/site ...     # with the mamba_ssm baseline importable
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_ssm.kernels.attention import (  # noqa: E402
    paged_decode_attention_ref,
    varlen_prefill_attention_ref,
    write_kv_cache_ref,
)
from pd_ssm.kernels.attention_decode_triton import (  # noqa: E402
    DecodeConfig,
    default_decode_config,
    launch_decode,
    paged_decode_attention_triton,
)
from pd_ssm.kernels.attention_prefill_triton import varlen_prefill_attention_triton  # noqa: E402
from pd_ssm.kernels.conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref  # noqa: E402
from pd_ssm.kernels.conv1d_triton import (  # noqa: E402
    VARLEN_TILE,
    ConvTile,
    causal_conv1d_update_triton,
    causal_conv1d_varlen_triton,
    launch_conv_varlen,
)
from pd_ssm.kernels.kv_write_triton import write_kv_cache_triton  # noqa: E402
from pd_ssm.kernels.rmsnorm import rms_norm_gated_ref, rms_norm_ref  # noqa: E402
from pd_ssm.kernels.rmsnorm_triton import rms_norm_gated_triton, rms_norm_triton  # noqa: E402
from pd_ssm.kernels.ssu import selective_state_update_ref  # noqa: E402
from pd_ssm.kernels.ssu_triton import (  # noqa: E402
    SSUConfig,
    default_config,
    launch_ssu,
    selective_state_update_triton,
)

# NOTE: without CUDA the script runs as a dry run of its own logic: Triton's interpreter on the CPU,
# tiny shapes, each timing a single call (TRITON_INTERPRET must then be set before triton is imported)
DRY = not torch.cuda.is_available()
DEV = torch.device("cpu" if DRY else "cuda")


def sz(gpu: int, dry: int) -> int:
    return dry if DRY else gpu


L2_BYTES = 60e6 if not DRY else 1e4
OUT = Path(os.environ.get("OUT", "out"))
NH, HD, DS = sz(80, 4), sz(64, 8), sz(128, 16)  # Mamba2-2.7B SSM
CONV_DIM, WIDTH = sz(5376, 84), 4
H, HKV, D, BLOCK = sz(32, 4), sz(8, 2), sz(128, 16), sz(16, 4)  # hybrid attention layer

checks: list[tuple[str, bool, str]] = []
rows: list[dict[str, Any]] = []
log_lines: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)
    log_lines.append(msg)


def check(name: str, ok: bool, detail: str = "") -> None:
    checks.append((name, bool(ok), detail))
    log(f"[{'ok' if ok else 'FAIL'}] {name} {detail}")


def close(name: str, out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> None:
    try:
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
        ok, detail = True, ""
    except AssertionError as e:
        ok, detail = False, str(e).splitlines()[1:4].__str__()
    err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    check(name, ok, f"rel_l2={err:.2e} {detail}")


def exact(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    diff = (a != b).sum().item()
    check(name, diff == 0, f"{diff} elements differ")


def bench(fn: Callable[[], object]) -> float:
    """do_bench median milliseconds (L2 flushed before each call; host launch time counts when it
    exceeds the flush)."""
    if DRY:
        fn()
        return 1.0
    return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))


def bench_graph(fns: Sequence[Callable[[], object]]) -> float:
    """GPU milliseconds per call: all input sets captured back to back in one CUDA graph, replayed
    (what the decode step's graphs see: no host launch time)."""
    if DRY:
        for f in fns:
            f()
        return 1.0
    calls = list(fns) * max(1, math.ceil(4 / len(fns)))
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    ms = float(do_bench(graph.replay, warmup=10, rep=60, return_mode="median")) / len(calls)
    del graph
    return ms


def host_us(fn: Callable[[], object], n: int = 200) -> float:
    """Eager back-to-back microseconds per call: the host launch time when the GPU keeps up."""
    for _ in range(10):
        fn()
    if not DRY:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n if not DRY else 2):
        fn()
    if not DRY:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (n if not DRY else 2) * 1e6


def measure(name: str, fns: Sequence[Callable[[], object]], *, nbytes: float | None = None,
            flops: float | None = None, base: Sequence[Callable[[], object]] | None = None, eager: bool = True,
            note: str = "") -> dict[str, Any]:
    """Graph time per call (the figure the rates use), and with `eager` also do_bench over the
    rotating sets and the host time per call; `base`: the same for the baseline's calls."""
    row: dict[str, Any] = {"name": name, "note": note}
    try:
        row["graph_us"] = bench_graph(fns) * 1e3
    except Exception as e:  # noqa: BLE001  (a call that cannot be captured: time it eagerly)
        it0 = itertools.cycle(fns)
        row["graph_us"] = bench(lambda: next(it0)()) * 1e3
        row["note"] = f"{note} no graph ({type(e).__name__}): do_bench".strip()
    if eager:
        it = itertools.cycle(fns)
        row["bench_us"] = bench(lambda: next(it)()) * 1e3
        row["host_us"] = host_us(fns[0])
    ms = row["graph_us"] / 1e3
    if nbytes is not None:
        row["GB/s"] = nbytes / ms / 1e6
        row["%copy"] = 100 * row["GB/s"] / COPY_GBS
    if flops is not None:
        row["TFLOP/s"] = flops / ms / 1e9
    if base is not None:
        try:
            row["base_us"] = bench_graph(base) * 1e3
        except Exception as e:  # noqa: BLE001
            it1 = itertools.cycle(base)
            row["base_us"] = bench(lambda: next(it1)()) * 1e3
            row["note"] = f"{row['note']} base: no graph ({type(e).__name__}): do_bench".strip()
        row["speedup"] = row["base_us"] / row["graph_us"]
    rows.append(row)
    log("  " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    return row


def sets_for(bytes_per_set: float) -> int:
    return max(1, min(64, math.ceil(2 * L2_BYTES / bytes_per_set)))


def section(fn: Callable[[], None]) -> None:
    t0 = time.time()
    log(f"== {fn.__name__}")
    try:
        fn()
    except Exception:
        check(fn.__name__, False, "raised")
        log(traceback.format_exc())
    log(f"   ({time.time() - t0:.1f} s)")


# --- ceiling ---------------------------------------------------------------------------------


def measure_copy() -> float:
    """Device copy, bytes read + written, 1 GiB: do_bench (the ceiling every %copy divides by)."""
    n = 1 << sz(28, 10)  # 1 GiB of fp32
    src = torch.randn(n, device=DEV)
    dst = torch.empty_like(src)
    ms = bench(partial(dst.copy_, src))
    del src, dst
    return 2 * 4 * n / ms / 1e6


def ceilings_section() -> None:
    """The copy again through a graph, and an in-place read-modify-write of one buffer (what the
    state updates do) as a second ceiling."""
    n = 1 << sz(28, 10)
    src = torch.randn(n, device=DEV)
    dst = torch.empty_like(src)
    measure("device copy 1 GiB (graph)", [partial(dst.copy_, src)], nbytes=8 * n, eager=False)
    measure("in-place x.mul_(c) 1 GiB (graph)", [partial(src.mul_, 0.99999)], nbytes=8 * n, eager=False)
    half = src[: n // 2].view(-1, 128)
    measure("in-place x.mul_(c) 512 MiB rows of 128 (graph)", [partial(half.mul_, 1.00001)], nbytes=4 * n,
            eager=False)


# --- conv ------------------------------------------------------------------------------------


def conv_section() -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    dt = torch.bfloat16
    w = torch.randn(CONV_DIM, WIDTH, device=DEV, generator=g).to(dt)
    bias = torch.randn(CONV_DIM, device=DEV, generator=g).to(dt)
    # correctness: varlen, lengths 1 and 2 (< width-1), long; initial state on and off
    lengths = [1, 2, 3, sz(2048, 40), 37, sz(700, 5), 1, 13]
    has_init = torch.tensor([True, True, False, True, False, True, False, True], device=DEV)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEV)
    T, S = sum(lengths), len(lengths)
    for pool_dt in (torch.bfloat16, torch.float32):
        x = torch.randn(T, CONV_DIM, device=DEV, generator=g).to(dt)
        pool = torch.randn(3 * S, CONV_DIM, WIDTH - 1, device=DEV, generator=g).to(pool_dt)
        slots = torch.randperm(3 * S, device=DEV, generator=g)[:S].to(torch.int32)
        pool_ref = pool.clone()
        out = causal_conv1d_varlen_triton(x, w, bias, pool, cu_seqlens=cu, state_indices=slots,
                                          has_initial_state=has_init)
        ref = causal_conv1d_varlen_ref(x, w, bias, pool_ref, cu_seqlens=cu, state_indices=slots,
                                       has_initial_state=has_init)
        close(f"conv varlen bf16 out (pool {pool_dt})", out, ref, 2e-2, 2e-2)
        exact(f"conv varlen pool incl. unused slots (pool {pool_dt})", pool, pool_ref)
    # correctness: update, batch 256
    Bt = sz(256, 6)
    x = torch.randn(Bt, CONV_DIM, device=DEV, generator=g).to(dt)
    pool = torch.randn(2 * Bt, CONV_DIM, WIDTH - 1, device=DEV, generator=g).to(dt)
    slots = torch.randperm(2 * Bt, device=DEV, generator=g)[:Bt].to(torch.int32)
    pool_ref = pool.clone()
    out = causal_conv1d_update_triton(x, pool, w, bias, state_indices=slots)
    ref = causal_conv1d_update_ref(x, pool_ref, w, bias, state_indices=slots)
    close("conv update bf16 out", out, ref, 2e-2, 2e-2)
    exact("conv update pool", pool, pool_ref)

    # timing: update at batch 1 / 256, pool rotated over disjoint slot sets
    for Bt in (1, sz(256, 5)):
        per_set = Bt * CONV_DIM * (WIDTH - 1) * 2
        n_sets = sets_for(per_set)
        pool = torch.randn(n_sets * Bt, CONV_DIM, WIDTH - 1, device=DEV, generator=g).to(dt)
        xs = [torch.randn(Bt, CONV_DIM, device=DEV, generator=g).to(dt) for _ in range(n_sets)]
        idx = [torch.arange(i * Bt, (i + 1) * Bt, device=DEV, dtype=torch.int32) for i in range(n_sets)]
        fns = [partial(causal_conv1d_update_triton, xs[i], pool, w, bias, state_indices=idx[i]) for i in range(n_sets)]
        nbytes = Bt * CONV_DIM * 2 * (2 * (WIDTH - 1) + 2)  # state read + write, x, out (bf16)
        measure(f"conv1d update B={Bt}", fns, nbytes=nbytes)

    # timing: varlen prefill 1 x 2048 and 16 x 128 with history, tiles swept
    for lengths in ([sz(2048, 32)], [sz(128, 4)] * sz(16, 3)):
        T, S = sum(lengths), len(lengths)
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEV)
        n_sets = sets_for(T * CONV_DIM * 2 * 2)
        xs = [torch.randn(T, CONV_DIM, device=DEV, generator=g).to(dt) for _ in range(n_sets)]
        pool = torch.randn(S * n_sets, CONV_DIM, WIDTH - 1, device=DEV, generator=g).to(dt)
        idx = [torch.arange(i * S, (i + 1) * S, device=DEV, dtype=torch.int32) for i in range(n_sets)]
        init = torch.ones(S, dtype=torch.bool, device=DEV)
        for tile in (VARLEN_TILE, ConvTile(8, 128, 4), ConvTile(8, 256, 8), ConvTile(4, 256, 4), ConvTile(4, 128, 2)):
            fns = [partial(launch_conv_varlen, xs[i], w, bias, pool, cu, idx[i], init, "silu", tile)
                   for i in range(n_sets)]
            tag = "default " if tile == VARLEN_TILE else ""
            measure(f"conv1d varlen {S}x{T // S} {tag}tile={tuple(tile)}", fns, nbytes=2 * T * CONV_DIM * 2,
                    eager=tile == VARLEN_TILE)


# --- SSU -------------------------------------------------------------------------------------


def import_baseline() -> Callable[..., Any] | None:
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        return selective_state_update  # type: ignore[no-any-return]
    except Exception as e:  # noqa: BLE001
        log(f"baseline not available: {e!r}")
        return None


def ssu_inputs(g: torch.Generator, Bt: int, act: torch.dtype) -> dict[str, torch.Tensor]:
    return dict(
        x=torch.randn(Bt, NH, HD, device=DEV, generator=g).to(act),
        dt=(torch.rand(Bt, NH, device=DEV, generator=g) * 2 - 1.5).to(act),
        B=torch.randn(Bt, 1, DS, device=DEV, generator=g).to(act),
        C=torch.randn(Bt, 1, DS, device=DEV, generator=g).to(act),
    )


def ssu_section() -> None:
    g = torch.Generator(device=DEV).manual_seed(1)
    act = torch.bfloat16
    A = -torch.exp(torch.rand(NH, device=DEV, generator=g) * 2 - 1)
    Dp = torch.randn(NH, device=DEV, generator=g)
    dt_bias = torch.rand(NH, device=DEV, generator=g) - 4.0
    base = import_baseline()

    # correctness: batch 64, fp32 and bf16 state, unused slots random and untouched
    for state_dt in (torch.float32, torch.bfloat16):
        Bt = sz(64, 3)
        inp = ssu_inputs(g, Bt, act)
        pool = torch.randn(2 * Bt, NH, HD, DS, device=DEV, generator=g).to(state_dt)
        slots = torch.randperm(2 * Bt, device=DEV, generator=g)[:Bt].to(torch.int32)
        pool_ref = pool.clone()
        for limit in ((0.0, math.inf), (0.01, 0.1)):
            pool_ref.copy_(pool)  # NOTE: each step from the same state (a bf16 pool may differ by an ulp)
            y = selective_state_update_triton(pool, inp["x"], inp["dt"], A, inp["B"], inp["C"], state_indices=slots,
                                              D=Dp, dt_bias=dt_bias, dt_limit=limit)
            y_ref = selective_state_update_ref(pool_ref, inp["x"], inp["dt"], A, inp["B"], inp["C"],
                                               state_indices=slots, D=Dp, dt_bias=dt_bias, dt_limit=limit)
            close(f"ssu y (state {state_dt}, limit {limit})", y, y_ref, 2.0**-7, 1e-2)
            if state_dt == torch.float32:
                close(f"ssu state fp32 (limit {limit})", pool, pool_ref, 1e-5, 1e-5)
            else:
                # identical fp32 values round identically; a 1e-6 difference may straddle a boundary
                frac = (pool != pool_ref).float().mean().item()
                close(f"ssu state bf16 (limit {limit}, {frac:.1e} differ)", pool, pool_ref, 2.0**-7, 1e-6)
        unused = torch.ones(2 * Bt, dtype=torch.bool, device=DEV)
        unused[slots.long()] = False
        check(f"ssu unused slots untouched ({state_dt})", torch.equal(pool[unused], pool_ref[unused]))

    def base_call(pool: torch.Tensor, inp: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        assert base is not None
        Bt = inp["x"].shape[0]
        return base(pool, inp["x"], inp["dt"][:, :, None].expand(Bt, NH, HD), A[:, None, None].expand(NH, HD, DS),
                    inp["B"], inp["C"], D=Dp[:, None].expand(NH, HD), z=None,
                    dt_bias=dt_bias[:, None].expand(NH, HD), dt_softplus=True, state_batch_indices=idx)

    if base is not None:  # the baseline computes the same function
        inp = ssu_inputs(g, 8, act)
        pool = torch.randn(8, NH, HD, DS, device=DEV, generator=g)
        pool_b = pool.clone()
        first8 = torch.arange(8, device=DEV, dtype=torch.int32)
        y = selective_state_update_triton(pool, inp["x"], inp["dt"], A, inp["B"], inp["C"], state_indices=first8, D=Dp,
                                          dt_bias=dt_bias)
        close("ssu matches mamba_ssm y", y, base_call(pool_b, inp, first8), 2.0**-7, 1e-2)
        close("ssu matches mamba_ssm state", pool, pool_b, 1e-5, 1e-5)

    # timing: batch 1 / 64 / 256, fp32 state; config sweep at 64 and 256
    state_bytes = NH * HD * DS * 4
    for Bt in (1, sz(64, 2), sz(256, 3)):
        n_sets = sets_for(Bt * state_bytes)
        pool = torch.randn(n_sets * Bt, NH, HD, DS, device=DEV, generator=g)
        inps = [ssu_inputs(g, Bt, act) for _ in range(n_sets)]
        idx = [torch.arange(i * Bt, (i + 1) * Bt, device=DEV, dtype=torch.int32) for i in range(n_sets)]
        nbytes = 2 * Bt * state_bytes
        base_fns = None
        if base is not None:
            base_fns = [partial(base_call, pool, inps[i], idx[i]) for i in range(n_sets)]
            measure(f"ssu mamba_ssm B={Bt}", base_fns, nbytes=nbytes)
        cfg0 = default_config(HD, DS, torch.float32)
        sweep = [cfg0]
        if Bt > 1:
            sweep += [c for c in (SSUConfig(bp, nw, sm, ev) for bp, nw in ((8, 4), (16, 4), (16, 8), (32, 8))
                                  for sm in (True, False) for ev in (False, True)) if c != cfg0]
        for cfg in sweep:
            fns = [partial(launch_ssu, pool, inps[i]["x"], inps[i]["dt"], A, inps[i]["B"], inps[i]["C"], idx[i], Dp,
                           dt_bias, True, (0.0, math.inf), cfg) for i in range(n_sets)]
            tag = "default " if cfg == cfg0 else ""
            measure(f"ssu B={Bt} {tag}p={cfg.block_p} w={cfg.num_warps} slot_major={int(cfg.slot_major)} "
                    f"evict_first={int(cfg.evict_first)}", fns, nbytes=nbytes,
                    base=base_fns if cfg == cfg0 else None, eager=cfg == cfg0)
        del pool
    # bf16 state, batch 64, default config
    Bt = sz(64, 2)
    n_sets = sets_for(Bt * state_bytes / 2)
    pool16 = torch.randn(n_sets * Bt, NH, HD, DS, device=DEV, generator=g).to(torch.bfloat16)
    inps = [ssu_inputs(g, Bt, act) for _ in range(n_sets)]
    slot_sets = [torch.arange(i * Bt, (i + 1) * Bt, device=DEV, dtype=torch.int32) for i in range(n_sets)]
    fns = [partial(selective_state_update_triton, pool16, inps[i]["x"], inps[i]["dt"], A, inps[i]["B"], inps[i]["C"],
                   state_indices=slot_sets[i], D=Dp, dt_bias=dt_bias) for i in range(n_sets)]
    measure(f"ssu B={Bt} bf16 state default", fns, nbytes=Bt * state_bytes)


# --- RMSNorm ---------------------------------------------------------------------------------


def norm_section() -> None:
    g = torch.Generator(device=DEV).manual_seed(2)
    for dt in (torch.bfloat16, torch.float32):
        x = (torch.randn(sz(2048, 3), sz(2560, 40), device=DEV, generator=g) * 3).to(dt)
        w = (1 + 0.2 * torch.randn(x.shape[1], device=DEV, generator=g)).to(dt)
        for fp32w in (False, True):
            out = rms_norm_triton(x, w, 1e-5, weight_in_fp32=fp32w)
            ref = rms_norm_ref(x, w, 1e-5, weight_in_fp32=fp32w)
            tol = (1e-5, 1e-6) if dt == torch.float32 else (2 * 2.0**-7, 1e-6)
            close(f"rms_norm {dt} weight_in_fp32={fp32w} ({(out != ref).float().mean().item():.1e} differ)",
                  out, ref, *tol)
        x = torch.randn(sz(512, 3), sz(5120, 64), device=DEV, generator=g).to(dt)
        z = (torch.randn(*x.shape, device=DEV, generator=g) * 2).to(dt)
        w = (1 + 0.2 * torch.randn(x.shape[1], device=DEV, generator=g)).to(dt)
        for gs in (x.shape[1], x.shape[1] // 8):
            out = rms_norm_gated_triton(x, z, w, 1e-5, gs)
            ref = rms_norm_gated_ref(x, z, w, 1e-5, gs)
            tol = (1e-5, 1e-6) if dt == torch.float32 else (2 * 2.0**-7, 1e-6)
            close(f"rms_norm_gated {dt} group {gs} ({(out != ref).float().mean().item():.1e} differ)", out, ref, *tol)
    dt = torch.bfloat16
    for T, d, gated in ((1, sz(2560, 40), False), (sz(256, 3), sz(2560, 40), False), (sz(4096, 5), sz(2560, 40), False),
                        (sz(256, 3), sz(5120, 64), True), (sz(4096, 5), sz(5120, 64), True)):
        per_set = T * d * 2 * (3 if gated else 2)
        n_sets = sets_for(per_set)
        xs = [torch.randn(T, d, device=DEV, generator=g).to(dt) for _ in range(n_sets)]
        zs = [torch.randn(T, d, device=DEV, generator=g).to(dt) for _ in range(n_sets)] if gated else xs
        w = torch.randn(d, device=DEV, generator=g).to(dt)
        if gated:
            fns = [partial(rms_norm_gated_triton, xs[i], zs[i], w, 1e-5, d) for i in range(n_sets)]
        else:
            fns = [partial(rms_norm_triton, xs[i], w, 1e-5) for i in range(n_sets)]
        measure(f"rms_norm{'_gated' if gated else ''} {T}x{d}", fns, nbytes=per_set)


# --- attention -------------------------------------------------------------------------------


def paged(g: torch.Generator, num_seqs: int, max_blocks: int, dt: torch.dtype) -> tuple[torch.Tensor, ...]:
    num_blocks = num_seqs * max_blocks + 5
    kc = torch.randn(num_blocks, BLOCK, HKV, D, device=DEV, generator=g).to(dt)
    vc = torch.randn(num_blocks, BLOCK, HKV, D, device=DEV, generator=g).to(dt)
    tables = torch.randperm(num_blocks, device=DEV, generator=g)[:num_seqs * max_blocks]
    return kc, vc, tables.view(num_seqs, max_blocks).to(torch.int32)


def gather_sdpa(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, q_lens: list[int],
                ctx_lens: list[int], scale: float) -> torch.Tensor:
    """The alternative to the Triton prefill kernel: gather each sequence's K/V out of the pages,
    then torch SDPA (flash when causal without context, else with a boolean mask)."""
    outs, start = [], 0
    for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        n = q_len + ctx
        pos = torch.arange(n, device=DEV)
        slots = tables[s].long()[pos // BLOCK] * BLOCK + pos % BLOCK
        keys = kc.view(-1, HKV, D)[slots].transpose(0, 1)  # [Hkv, n, D]
        vals = vc.view(-1, HKV, D)[slots].transpose(0, 1)
        qs = q[start:start + q_len].transpose(0, 1)  # [H, q_len, D]
        start += q_len
        if ctx == 0:
            o = torch.nn.functional.scaled_dot_product_attention(qs, keys, vals, is_causal=True, scale=scale,
                                                                 enable_gqa=True)
        else:
            mask = pos[None, :] <= torch.arange(ctx, n, device=DEV)[:, None]  # [q_len, n]
            o = torch.nn.functional.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=scale,
                                                                 enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def attention_section() -> None:
    g = torch.Generator(device=DEV).manual_seed(3)
    scale = D**-0.5
    # correctness: write
    for src_dt, dt in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)):
        kc, vc, _ = paged(g, 4, sz(64, 4), dt)
        T = sz(1000, 20)
        k = torch.randn(T, HKV, D, device=DEV, generator=g).to(src_dt)
        v = torch.randn(T, HKV, D, device=DEV, generator=g).to(src_dt)
        slots = torch.randperm(kc.shape[0] * BLOCK, device=DEV, generator=g)[:T]
        slots[::7] = -1
        kc_ref, vc_ref = kc.clone(), vc.clone()
        write_kv_cache_triton(k, v, kc, vc, slots)
        write_kv_cache_ref(k, v, kc_ref, vc_ref, slots)
        exact(f"write_kv_cache {src_dt}->{dt}", torch.stack([kc, vc]), torch.stack([kc_ref, vc_ref]))
    # correctness: decode, batch 64 (and 1: split), context up to 2048
    for dt in (torch.bfloat16, torch.float32):
        for B in (sz(64, 3), 1):
            mb = sz(128, 5)
            kc, vc, tables = paged(g, B, mb, dt)
            seq_lens = torch.randint(1, mb * BLOCK + 1, (B,), device=DEV, generator=g).to(torch.int32)
            seq_lens[0] = mb * BLOCK
            q = torch.randn(B, H, D, device=DEV, generator=g).to(dt)
            out = paged_decode_attention_triton(q, kc, vc, seq_lens=seq_lens, block_tables=tables, scale=scale)
            ref = paged_decode_attention_ref(q, kc, vc, seq_lens=seq_lens, block_tables=tables, scale=scale)
            tol = (2e-5, 2e-5) if dt == torch.float32 else (2.0**-7, 1e-3)
            close(f"decode attention {dt} B={B}", out, ref, *tol)
    # correctness: chunked prefill with context
    for dt in (torch.bfloat16, torch.float32):
        q_lens, contexts = [sz(2048, 20), 1, sz(300, 7), sz(512, 5), 17], [0, sz(700, 9), 33, sz(1536, 4), 0]
        seq_lens = torch.tensor([a + b for a, b in zip(q_lens, contexts, strict=True)], dtype=torch.int32, device=DEV)
        cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEV)
        kc, vc, tables = paged(g, len(q_lens), sz(128, 13), dt)
        q = torch.randn(sum(q_lens), H, D, device=DEV, generator=g).to(dt)
        out = varlen_prefill_attention_triton(q, kc, vc, cu_seqlens_q=cu_q, seq_lens=seq_lens, block_tables=tables,
                                              scale=scale)
        ref = varlen_prefill_attention_ref(q, kc, vc, cu_seqlens_q=cu_q, seq_lens=seq_lens, block_tables=tables,
                                           scale=scale)
        tol = (2e-5, 2e-5) if dt == torch.float32 else (2e-2, 2e-2)
        close(f"prefill attention {dt}", out, ref, *tol)

    dt = torch.bfloat16
    # timing: write 2048 tokens
    T = sz(2048, 8)
    kc, vc, _ = paged(g, 1, sz(4096, 8), dt)
    n_sets = sz(16, 2)
    ks = [torch.randn(T, HKV, D, device=DEV, generator=g).to(dt) for _ in range(n_sets)]
    slot_sets = [torch.randperm(kc.shape[0] * BLOCK, device=DEV, generator=g)[:T] for _ in range(n_sets)]
    measure(f"write_kv_cache T={T}", [partial(write_kv_cache_triton, ks[i], ks[i], kc, vc, slot_sets[i])
                                      for i in range(n_sets)], nbytes=2 * 2 * T * HKV * D * 2)
    # timing: decode at batch 1 / 64, context 4096
    ctx = sz(4096, 32)
    for B in (1, sz(64, 2)):
        kv_bytes = 2 * B * ctx * HKV * D * 2
        n_sets = sets_for(kv_bytes)
        kc, vc, tables = paged(g, B * n_sets, ctx // BLOCK, dt)
        qs = [torch.randn(B, H, D, device=DEV, generator=g).to(dt) for _ in range(n_sets)]
        lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
        cfg0 = default_decode_config(dt, dt, H // HKV, D)
        for cfg in (cfg0, DecodeConfig(True, 32, 4), DecodeConfig(True, 128, 8), DecodeConfig(True, 64, 4, 2),
                    DecodeConfig(False, 16, 4)):
            dec_fns = [partial(launch_decode, qs[i], kc, vc, lens, tables[i * B:(i + 1) * B], scale, cfg)
                       for i in range(n_sets)]
            tag = "default " if cfg == cfg0 else ""
            measure(f"decode attention B={B} ctx={ctx} {tag}dot={int(cfg.use_dot)} n={cfg.block_n} "
                    f"w={cfg.num_warps} st={cfg.num_stages}", dec_fns, nbytes=kv_bytes, eager=cfg == cfg0)
    # timing: prefill, Triton vs gather + torch SDPA (which needs the lengths on the host)
    for q_lens, ctx_lens in (([sz(2048, 20)], [0]), ([sz(512, 6)] * 4, [sz(1536, 7)] * 4)):
        S = len(q_lens)
        seq_list = [a + b for a, b in zip(q_lens, ctx_lens, strict=True)]
        seq_lens = torch.tensor(seq_list, dtype=torch.int32, device=DEV)
        cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEV)
        kc, vc, tables = paged(g, S, max(seq_list) // BLOCK + 1, dt)
        q = torch.randn(sum(q_lens), H, D, device=DEV, generator=g).to(dt)
        flops = 4 * H * D * sum(c * n + n * (n + 1) / 2 for n, c in zip(q_lens, ctx_lens, strict=True))
        sdpa = partial(gather_sdpa, q, kc, vc, tables, q_lens, ctx_lens, scale)
        close(f"gather+SDPA agrees ({S}x{q_lens[0]})", sdpa(),
              varlen_prefill_attention_triton(q, kc, vc, cu_seqlens_q=cu_q, seq_lens=seq_lens, block_tables=tables,
                                              scale=scale), 2e-2, 2e-2)
        tag = f"{S}x{q_lens[0]} ctx {ctx_lens[0]}"
        fn = partial(varlen_prefill_attention_triton, q, kc, vc, cu_seqlens_q=cu_q, seq_lens=seq_lens,
                     block_tables=tables, scale=scale)
        measure(f"prefill attention triton {tag}", [fn], flops=flops, base=[sdpa], note="base = gather + torch SDPA")


# --- CUDA graphs: the decode-path kernels capture (no host sync) and replay the same ------------


def graph_section() -> None:
    g = torch.Generator(device=DEV).manual_seed(4)
    dt = torch.bfloat16
    Bt = 8
    w = torch.randn(CONV_DIM, WIDTH, device=DEV, generator=g).to(dt)
    xc = torch.randn(Bt, CONV_DIM, device=DEV, generator=g).to(dt)
    cpool = torch.randn(Bt, CONV_DIM, WIDTH - 1, device=DEV, generator=g).to(dt)
    idx = torch.arange(Bt, device=DEV, dtype=torch.int32)
    inp = ssu_inputs(g, Bt, dt)
    A = -torch.rand(NH, device=DEV, generator=g) - 0.1
    spool = torch.randn(Bt, NH, HD, DS, device=DEV, generator=g)
    kc, vc, tables = paged(g, Bt, 32, dt)
    kv = torch.randn(Bt, HKV, D, device=DEV, generator=g).to(dt)
    q = torch.randn(Bt, H, D, device=DEV, generator=g).to(dt)
    lens = torch.randint(1, 32 * BLOCK, (Bt,), device=DEV, generator=g).to(torch.int32)
    slot_map = (tables[:, 0].long() * BLOCK)

    def step() -> list[torch.Tensor]:
        a = causal_conv1d_update_triton(xc, cpool, w, None, state_indices=idx)
        b = selective_state_update_triton(spool, inp["x"], inp["dt"], A, inp["B"], inp["C"], state_indices=idx)
        write_kv_cache_triton(kv, kv, kc, vc, slot_map)
        c = paged_decode_attention_triton(q, kc, vc, seq_lens=lens, block_tables=tables, scale=0.1)
        c1 = paged_decode_attention_triton(q[:1], kc, vc, seq_lens=lens[:1], block_tables=tables[:1], scale=0.1)
        return [a, b, c, c1]

    saved = [t.clone() for t in (cpool, spool, kc, vc)]
    step()  # compile outside the capture
    torch.cuda.synchronize()
    for t, s in zip((cpool, spool, kc, vc), saved, strict=True):
        t.copy_(s)
    eager = [t.clone() for t in step()]
    eager_state = [t.clone() for t in (cpool, spool)]
    for t, s in zip((cpool, spool, kc, vc), saved, strict=True):
        t.copy_(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t, s in zip((cpool, spool, kc, vc), saved, strict=True):
        t.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(outs, eager, strict=True))
    same = same and all(torch.equal(a, b) for a, b in zip((cpool, spool), eager_state, strict=True))
    check("decode-path kernels captured in a CUDA graph, replay == eager", same)


def main() -> None:
    global COPY_GBS
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    name = "dry run (CPU, Triton interpreter)" if DRY else torch.cuda.get_device_name()
    log(f"device {name} torch {torch.__version__} triton {triton.__version__}")
    COPY_GBS = measure_copy()
    log(f"device copy: {COPY_GBS:.0f} GB/s (read + write)")
    rows.append({"name": "device copy 1 GiB (do_bench)", "GB/s": COPY_GBS, "%copy": 100.0})
    for sec in ((graph_section,) if not DRY else ()) + (ceilings_section, ssu_section, conv_section, norm_section,
                                                        attention_section):
        section(sec)
    (OUT / "results.json").write_text(json.dumps({"copy_GBs": COPY_GBS, "rows": rows, "checks": checks}, indent=1))
    (OUT / "log.txt").write_text("\n".join(log_lines))
    failed = [c for c in checks if not c[1]]
    print(f"\n{len(checks) - len(failed)}/{len(checks)} checks passed; failed: {[c[0] for c in failed]}")
    print("graph = GPU us per call in a CUDA graph (rates use it); bench = do_bench us; host = eager us/call")
    print(f"{'kernel':60s} {'graph':>7s} {'bench':>7s} {'host':>6s} {'GB/s':>5s} {'%cp':>5s} {'TF/s':>5s} "
          f"{'base':>7s} {'x':>5s}")
    for r in rows:
        f = partial(_cell, r)
        print(f"{r['name'][:60]:60s} {f('graph_us', '7.1f'):>7s} {f('bench_us', '7.1f'):>7s} {f('host_us', '6.1f'):>6s} "
              f"{f('GB/s', '5.0f'):>5s} {f('%copy', '5.1f'):>5s} {f('TFLOP/s', '5.0f'):>5s} {f('base_us', '7.1f'):>7s} "
              f"{f('speedup', '5.2f'):>5s}")
    print(f"total {time.time() - t0:.0f} s")


def _cell(r: dict[str, Any], key: str, fmt: str) -> str:
    return format(r[key], fmt) if key in r else "-"


COPY_GBS = float("nan")

if __name__ == "__main__":
    main()
