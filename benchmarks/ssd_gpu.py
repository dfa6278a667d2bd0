"""Correctness at real shapes and timing of the Triton SSD scan against mamba_ssm, in one device call.

Mamba2-2.7B shapes (nheads 80, headdim 64, dstate 128, ngroups 1, chunk 256), bf16 x/dt/B/C, fp32
A/D/dt_bias and state pool. Run from the repository root on the GPU machine:

    pip install -q --no-index --no-deps --target /tmp/site third_party/wheels/*.whl
    PYTHONPATH=third_party/baseline:/tmp/site:. python3 benchmarks/ssd_gpu.py

First a small config sweep (each candidate timed on three cases and checked on a varlen batch),
then, with the fastest valid config, the correctness checks and timings of every case. Writes
$OUT/ssd_results.json; prints a short table last. The kernel breakdown is skipped past
SSD_BENCH_DEADLINE seconds (default 300).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from triton.testing import do_bench

from pd_ssm.kernels.ssd import mamba_chunk_scan_varlen_ref
from pd_ssm.kernels.ssd_config import SSDConfig, default_config
from pd_ssm.kernels.ssd_triton import ssd_scan_with_config

H, P, N, G, Q = 80, 64, 128, 1, 256
DEV = torch.device("cuda")
OUT = os.environ.get("OUT", "out")
START = time.time()
DEADLINE = float(os.environ.get("SSD_BENCH_DEADLINE", 300))
RESULTS: dict[str, Any] = {"cases": {}, "sweep": {}, "profile": {}}
CASES: dict[str, tuple[list[int], str]] = {
    "1x2048": ([2048], "fresh"),
    "1x8192": ([8192], "fresh"),
    "1x32768": ([32768], "fresh"),
    "16x1024 aligned": ([1024] * 16, "aligned"),
    "16x1024 unaligned": ([1024] * 16, "unaligned"),
}
try:
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
except Exception as e:  # noqa: BLE001
    mamba_chunk_scan_combined = None
    print("baseline not available:", repr(e), flush=True)


def log(*a: object) -> None:
    print(f"[{time.time() - START:6.1f}s]", *a, flush=True)


@dataclass
class Inputs:
    x: torch.Tensor  # [T, H, P]
    dt: torch.Tensor  # [T, H] raw
    A: torch.Tensor  # [H] fp32
    B: torch.Tensor  # [T, G, N]
    C: torch.Tensor  # [T, G, N]
    D: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]
    cu: torch.Tensor  # [S+1] int32
    ctx: torch.Tensor  # [S] int32
    pool: torch.Tensor  # [S+2, H, P, N] fp32
    slots: torch.Tensor  # [S] int32
    has_init: torch.Tensor  # [S] bool
    seq_idx: torch.Tensor  # [1, T] int32, for mamba_ssm
    init0: torch.Tensor | None  # [1, H, P, N]: mamba_ssm's batch of one takes one initial state


def make_inputs(lengths: list[int], mode: str, seed: int, dtype: torch.dtype = torch.bfloat16) -> Inputs:
    g = torch.Generator(device=DEV).manual_seed(seed)
    T, S = sum(lengths), len(lengths)

    def rn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEV, generator=g)

    def un(lo: float, hi: float, n: int) -> torch.Tensor:
        return torch.rand(n, device=DEV, generator=g) * (hi - lo) + lo

    dt_init = torch.exp(un(math.log(1e-3), math.log(1e-1), H))  # Mamba2's dt initialisation
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    if mode == "fresh":
        ctx = torch.zeros(S, dtype=torch.int32, device=DEV)
    elif mode == "aligned":
        ctx = torch.randint(0, 32, (S,), device=DEV, generator=g).int() * Q
    else:
        ctx = torch.randint(1, 8192, (S,), device=DEV, generator=g).int()
        ctx = torch.where(ctx % Q == 0, ctx + 1, ctx)
    seq_idx = torch.repeat_interleave(torch.arange(S, dtype=torch.int32, device=DEV),
                                      torch.tensor(lengths, device=DEV))[None]
    pool = rn(S + 2, H, P, N) * 0.5
    slots = torch.randperm(S + 2, device=DEV, generator=g)[:S].int()
    return Inputs(
        x=rn(T, H, P).to(dtype), dt=(rn(T, H) * 0.5).to(dtype),
        A=-torch.exp(un(0.0, math.log(16.0), H)), B=rn(T, G, N).to(dtype), C=rn(T, G, N).to(dtype),
        D=un(0.5, 1.5, H), dt_bias=dt_init + torch.log(-torch.expm1(-dt_init)),  # softplus^-1
        cu=cu, ctx=ctx, pool=pool, slots=slots, has_init=torch.full((S,), mode != "fresh", device=DEV),
        seq_idx=seq_idx.int(), init0=None if mode == "fresh" else pool[slots[:1].long()].clone(),
    )


def upcast(i: Inputs) -> Inputs:
    return replace(i, x=i.x.float(), dt=i.dt.float(), B=i.B.float(), C=i.C.float())


def ours(i: Inputs, cfg: SSDConfig | None = None, boundaries: bool = False) -> Any:
    return ssd_scan_with_config(
        i.x, i.dt, i.A, i.B, i.C, Q, cu_seqlens=i.cu, context_lens=i.ctx, ssm_state=i.pool,
        state_indices=i.slots, has_initial_state=i.has_init, D=i.D, dt_bias=i.dt_bias, dt_softplus=True,
        dt_limit=(0.0, float("inf")), return_boundary_states=boundaries,
        config=cfg,
    )


def ref(i: Inputs) -> Any:
    return mamba_chunk_scan_varlen_ref(
        i.x, i.dt, i.A, i.B, i.C, Q, cu_seqlens=i.cu, context_lens=i.ctx, ssm_state=i.pool,
        state_indices=i.slots, has_initial_state=i.has_init, D=i.D, dt_bias=i.dt_bias,
        return_boundary_states=True,
    )


def mamba(i: Inputs) -> Any:
    assert mamba_chunk_scan_combined is not None
    S = i.cu.numel() - 1
    kw: dict[str, Any] = dict(D=i.D, dt_bias=i.dt_bias, dt_softplus=True, initial_states=i.init0)
    if S == 1:
        kw.update(return_final_states=True)
    else:
        kw.update(seq_idx=i.seq_idx, cu_seqlens=i.cu, return_varlen_states=True)
    return mamba_chunk_scan_combined(i.x[None], i.dt[None], i.A, i.B[None], i.C[None], Q, **kw)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def poison_allocator() -> None:
    """Fill the caching allocator's free memory with NaN: an unwritten output element shows."""
    free = torch.cuda.mem_get_info()[0]
    t = torch.empty(min(free // 2, 8 << 30) // 4, device=DEV).fill_(float("nan"))
    del t


def check(name: str, lengths: list[int], mode: str, cfg: SSDConfig) -> dict[str, Any]:
    i = make_inputs(lengths, mode, seed=len(name))
    ref_pool = i.pool.clone()
    r = ref(upcast(replace(i, pool=ref_pool)))
    slots = i.slots.long()
    unused = sorted(set(range(i.pool.shape[0])) - set(slots.tolist()))
    res: dict[str, Any] = {}
    for label, inp in (("bf16", i), ("fp32", upcast(i))):
        poison_allocator()
        pool = i.pool.clone()
        o = ours(replace(inp, pool=pool), cfg if label == "bf16" else None, boundaries=True)
        torch.cuda.synchronize()
        res[f"{label}_out_rel"] = rel(o.out, r.out)
        res[f"{label}_state_rel"] = rel(pool[slots], ref_pool[slots])
        res[f"{label}_bstates_rel"] = rel(o.boundary_states, r.boundary_states) if r.boundary_states.numel() else 0.0
        res[f"{label}_ok_shape"] = bool(o.boundary_cu.tolist() == r.boundary_cu.tolist()
                                        and torch.isfinite(o.out).all().item()
                                        and torch.equal(pool[unused], i.pool[unused]))
    if mamba_chunk_scan_combined is not None:
        res["mamba_out_rel"] = rel(mamba(replace(i, pool=i.pool.clone()))[0][0], r.out)
    log(name, json.dumps({k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in res.items()}))
    return res


def rotating(lengths: list[int], mode: str) -> list[Inputs]:
    per_set = sum(lengths) * H * (P * 2 * 2 + 2) + (len(lengths) + 2) * H * P * N * 4  # x, out, dt, pool
    return [make_inputs(lengths, mode, seed=100 + k) for k in range(max(1, math.ceil(240e6 / per_set)))]


def bench(fn: Callable[[Inputs], Any], sets: list[Inputs], rep: int = 100) -> float:
    k = [0]

    def step() -> None:
        fn(sets[k[0] % len(sets)])
        k[0] += 1

    return do_bench(step, warmup=25, rep=rep, return_mode="median")


def bench_graph(sets: list[Inputs], cfg: SSDConfig) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in sets:
            ours(i, cfg)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in sets:
            ours(i, cfg)
    return do_bench(g.replay, warmup=25, rep=100, return_mode="median") / len(sets)


def kernel_breakdown(fn: Callable[[], Any], calls: int = 5) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
        if t > 0:
            out[e.key[:60]] = round(t / calls / 1000, 4)  # ms per call
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:12])


def ceilings() -> dict[str, float]:
    a = torch.empty(1 << 28, device=DEV)  # 1 GiB
    b = torch.empty_like(a)
    t = do_bench(lambda: b.copy_(a), return_mode="median")
    m = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    tm = do_bench(lambda: m @ m, return_mode="median")
    return {"copy_TBps": 2 * a.numel() * 4 / t / 1e9, "bf16_mm_TFLOPs": 2 * 8192**3 / tm / 1e9}


def scan_cfg(heads: int, bm: int, bk: int, warps: int, stages: int) -> dict[str, Any]:
    return dict(scan_heads=heads, scan_block_m=bm, scan_block_k=bk, scan_warps=warps, scan_stages=stages)


# run 1 (see NOTES_ssd.md) left the passing kernel insensitive to its block; these are the scan and
# state shapes that compile without spills (offline ptxas, sm_90), stage A then stage B
SCAN_SWEEP = [scan_cfg(*c) for c in [(1, 64, 32, 4, 3), (1, 128, 32, 8, 3), (2, 64, 32, 4, 3), (2, 128, 32, 8, 3),
                                     (4, 64, 32, 8, 3), (2, 64, 64, 4, 2), (4, 128, 32, 8, 3)]]
STATE_SWEEP: list[dict[str, Any]] = [dict(state_block_k=bk, state_warps=w, state_stages=st, state_block_n=bn, state_reread=rr)
               for bk, w, st, bn, rr in [(64, 4, 3, 128, True), (64, 4, 3, 64, True), (32, 4, 4, 128, True),
                                         (64, 8, 3, 128, True), (64, 4, 3, 128, False), (64, 4, 3, 64, False)]]


def sweep() -> SSDConfig:
    """Time candidate configs on three cases, check each on a varlen batch; the fastest valid wins."""
    cases = {n: rotating(*CASES[n]) for n in ("1x8192", "1x32768", "16x1024 unaligned")}
    probe = make_inputs(*CASES["16x1024 unaligned"], seed=5)
    ref_pool = probe.pool.clone()
    r = ref(upcast(replace(probe, pool=ref_pool)))
    slots = probe.slots.long()

    def score(cfg: SSDConfig) -> float:
        key = json.dumps(asdict(cfg), sort_keys=True)
        try:
            pool = probe.pool.clone()
            o = ours(replace(probe, pool=pool), cfg)
            errs = (rel(o.out, r.out), rel(pool[slots], ref_pool[slots]))
            def run(i: Inputs) -> Any:
                return ours(i, cfg)

            ts = {n: bench(run, sets, rep=50) for n, sets in cases.items()}
        except Exception as e:  # noqa: BLE001
            RESULTS["sweep"][key] = {"error": repr(e)[:300]}
            log("sweep", key, "ERROR", repr(e)[:300])
            return math.inf
        geo = math.exp(sum(math.log(t) for t in ts.values()) / len(ts))
        RESULTS["sweep"][key] = {**ts, "geo": geo, "out_rel": errs[0], "state_rel": errs[1]}
        log("sweep", {k: v for k, v in asdict(cfg).items() if k.startswith(("scan", "state"))},
            {n: round(t, 4) for n, t in ts.items()}, f"err {errs[0]:.1e} {errs[1]:.1e}")
        return geo if max(errs) < 5e-3 else math.inf

    best = default_config(torch.bfloat16)
    for stage in (SCAN_SWEEP, STATE_SWEEP):
        scored = [(score(replace(best, **v)), i, replace(best, **v)) for i, v in enumerate(stage)]
        t, _, cfg = min(scored)
        if math.isfinite(t):
            best = cfg
    cases.clear()
    torch.cuda.empty_cache()
    return best


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    log(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", __import__("triton").__version__)
    RESULTS["ceilings"] = ceilings()
    log("ceilings", RESULTS["ceilings"])
    best = sweep()
    RESULTS["best_config"] = asdict(best)
    log("best", asdict(best))
    for name, (lengths, mode) in CASES.items():
        c: dict[str, Any] = {}
        try:
            c.update(check(name, lengths, mode, best))
        except Exception:  # noqa: BLE001
            c["check_error"] = traceback.format_exc()
            log(name, "CHECK FAILED", c["check_error"])
        torch.cuda.empty_cache()
        sets = rotating(lengths, mode)
        c["sets"] = len(sets)
        c["ours_ms"] = bench(lambda i: ours(i, best), sets)
        c["ours_graph_ms"] = bench_graph(sets, best)
        if mamba_chunk_scan_combined is not None:
            c["mamba_ms"] = bench(mamba, sets)
            c["ratio"] = c["mamba_ms"] / c["ours_ms"]
        log(name, {k: v for k, v in c.items() if k.endswith("ms") or k == "ratio"})
        RESULTS["cases"][name] = c
        del sets
        torch.cuda.empty_cache()
        json.dump(RESULTS, open(f"{OUT}/ssd_results.json", "w"), indent=1, default=str)

    small = make_inputs([256], "fresh", seed=7)  # launch-bound: host time per call
    for label, fn in (("ours", lambda i: ours(i, best)), ("mamba", mamba)):
        if label == "mamba" and mamba_chunk_scan_combined is None:
            continue
        fn(small)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            fn(small)
        torch.cuda.synchronize()
        RESULTS[f"host_us_per_call_{label}_1x256"] = (time.perf_counter() - t) / 200 * 1e6
    log("host", {k: round(v, 1) for k, v in RESULTS.items() if k.startswith("host")})

    for name in ("1x32768", "16x1024 unaligned"):
        if time.time() - START > DEADLINE:
            break
        i = make_inputs(*CASES[name], seed=3)
        RESULTS["profile"][name] = {"ours": kernel_breakdown(functools.partial(ours, i, best))}
        log("profile", name, json.dumps(RESULTS["profile"][name]))
    json.dump(RESULTS, open(f"{OUT}/ssd_results.json", "w"), indent=1, default=str)

    print("\nbest config:", asdict(best))
    print("\n| case | ours ms | ours graph ms | mamba ms | ratio | bf16 out rel | bf16 state rel | fp32 out rel | fp32 state rel |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, c in RESULTS["cases"].items():
        def f(k: str, fmt: str = ".3f", c: dict[str, Any] = c) -> str:
            return format(c[k], fmt) if k in c else "-"
        print(f"| {name} | {f('ours_ms')} | {f('ours_graph_ms')} | {f('mamba_ms')} | {f('ratio', '.2f')} | "
              f"{f('bf16_out_rel', '.1e')} | {f('bf16_state_rel', '.1e')} | {f('fp32_out_rel', '.1e')} | "
              f"{f('fp32_state_rel', '.1e')} |")


if __name__ == "__main__":
    main()
