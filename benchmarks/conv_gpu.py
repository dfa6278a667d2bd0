"""Causal conv1d Triton kernels on a CUDA device: correctness at Mamba2-2.7B shapes, then timings.

Shapes: conv_dim 5376, width 4, bf16 activations; x is the xBC column slice of an in_proj output
[T, 10576] (row stride 10576, as the mixer passes it); state pools bf16 and fp32.

Checks (exit status 1 if any fails): outputs against the torch references to 1e-6 relative L2 (the
count of differing elements is printed too), pools bit-exact including unused slots, a batch padded
with empty sequences equal to the unpadded one, a negative decode slot leaving the pool alone.
Timings: `do_bench(return_mode="median")` eager, and GPU time per call of N calls captured back
to back in one CUDA graph (what graph-captured steps see), inputs rotated over disjoint sets;
GB/s counts the bytes a call must move and is set against a device copy measured in this run.
The old kernels are replaced, so the previous figures (benchmarks/NOTES_small_kernels.md) are
printed for context only.

    python benchmarks/conv_gpu.py        # results in $OUT/conv_gpu.json (default /tmp/out)

Without CUDA it is a dry run of its own logic (Triton's interpreter, tiny shapes, one call per
timing; the bf16 checks fail there: the interpreter truncates fp32 -> bf16).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

# NOTE: TRITON_INTERPRET is read when a kernel is decorated, so it is set before pd_ssm's import
DRY = not torch.cuda.is_available()
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_ssm.kernels.conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref  # noqa: E402
from pd_ssm.kernels.conv1d_triton import (  # noqa: E402
    VARLEN_TILE,
    ConvTile,
    UpdateTile,
    causal_conv1d_update_triton,
    causal_conv1d_varlen_triton,
    default_update_tile,
    launch_conv_update,
    launch_conv_varlen,
)


def sz(gpu: int, dry: int) -> int:
    return dry if DRY else gpu


DEV = torch.device("cpu" if DRY else "cuda")
D_INNER, CONV_DIM, NHEADS, WIDTH = sz(5120, 16), sz(5376, 40), sz(80, 4), 4  # Mamba2-2.7B in_proj: z, xBC, dt
PROJ = D_INNER + CONV_DIM + NHEADS  # 10576
ACT = torch.bfloat16
OUT = Path(os.environ.get("OUT", "/tmp/out"))
T0 = time.time()
SWEEP_UNTIL_S = 40.0  # NOTE: past this, only the default tiles are timed (the run must stay < 60 s)
PREVIOUS_US = {"varlen 1x2048": 50.6, "varlen 16x128": 49.7, "update B=1": 6.0, "update B=256": 25.4}

checks: list[dict[str, Any]] = []
rows: list[dict[str, Any]] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    checks.append(dict(name=name, ok=bool(ok), detail=detail))
    print(f"[{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)


def close(name: str, out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-6) -> None:
    err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    ndiff = int((out != ref).sum().item())
    maxd = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    check(name, err <= rel, f"rel_l2={err:.2e} differing={ndiff}/{out.numel()} max_abs={maxd:.2e}")


def exact(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    ndiff = int((a != b).sum().item())
    check(name, ndiff == 0, f"{ndiff} elements differ")


def xbc_of(g: torch.Generator, T: int) -> torch.Tensor:
    """The xBC columns of an in_proj output: [T, CONV_DIM] with row stride PROJ."""
    proj = torch.randn(T, PROJ, device=DEV, generator=g).to(ACT)
    return proj[:, D_INNER:D_INNER + CONV_DIM]


def cu_of(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEV)


def i32(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=DEV)


def conv_params(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(CONV_DIM, WIDTH, device=DEV, generator=g) * 0.5).to(ACT)
    b = torch.randn(CONV_DIM, device=DEV, generator=g).to(ACT)
    return w, b


# --- correctness ------------------------------------------------------------------------------


def check_varlen(g: torch.Generator, pool_dt: torch.dtype) -> None:
    lengths = [1, 2, 3, 37, 130, 700, 2048] if not DRY else [1, 2, 3, 5, 9, 17, 33]
    has_init = [True, True, False, True, False, True, True]
    S, T = len(lengths), sum(lengths)
    x = xbc_of(g, T)
    w, b = conv_params(g)
    pool = torch.randn(2 * S, CONV_DIM, WIDTH - 1, device=DEV, generator=g).to(pool_dt)
    slots = torch.randperm(2 * S, device=DEV, generator=g)[:S].to(torch.int32)
    init = torch.tensor(has_init, device=DEV)
    before, pool_ref = pool.clone(), pool.clone()
    out = causal_conv1d_varlen_triton(x, w, b, pool, cu_seqlens=cu_of(lengths), state_indices=slots,
                                      has_initial_state=init)
    ref = causal_conv1d_varlen_ref(x, w, b, pool_ref, cu_seqlens=cu_of(lengths), state_indices=slots,
                                   has_initial_state=init)
    close(f"varlen out, pool {pool_dt}", out, ref)
    exact(f"varlen pool incl. unused slots, pool {pool_dt}", pool, pool_ref)
    # the same batch padded with empty sequences (slots -1, a live one, a free one) as graphs pad it
    pad_lengths = [0, *lengths[:3], 0, 0, *lengths[3:], 0]
    free = [s for s in range(2 * S) if s not in set(slots.tolist())][0]
    sl = slots.tolist()
    pad_slots = [-1, *sl[:3], sl[0], free, *sl[3:], -1]
    pad_init = [True, *has_init[:3], False, True, *has_init[3:], True]
    pool_pad = before.clone()
    out_pad = causal_conv1d_varlen_triton(x, w, b, pool_pad, cu_seqlens=cu_of(pad_lengths),
                                          state_indices=i32(pad_slots),
                                          has_initial_state=torch.tensor(pad_init, device=DEV))
    exact(f"varlen padded with empty sequences: out, pool {pool_dt}", out_pad, out)
    exact(f"varlen padded with empty sequences: pool, pool {pool_dt}", pool_pad, pool)


def check_update(g: torch.Generator, B: int, pool_dt: torch.dtype) -> None:
    x = xbc_of(g, B)
    w, b = conv_params(g)
    pool = torch.randn(2 * B + 1, CONV_DIM, WIDTH - 1, device=DEV, generator=g).to(pool_dt)
    slots = torch.randperm(2 * B + 1, device=DEV, generator=g)[:B].to(torch.int32)
    pool_ref = pool.clone()
    out = causal_conv1d_update_triton(x, pool, w, b, state_indices=slots)
    ref = causal_conv1d_update_ref(x, pool_ref, w, b, state_indices=slots)
    close(f"update B={B} out, pool {pool_dt}", out, ref)
    exact(f"update B={B} pool incl. unused slots, pool {pool_dt}", pool, pool_ref)
    if B > 1:  # a padding row (negative slot) in the middle: zeros out, pool untouched
        padded = slots.clone()
        padded[B // 2] = -1
        out_p = causal_conv1d_update_triton(x, pool, w, b, state_indices=padded)
        keep = [i for i in range(B) if i != B // 2]
        ref_p = causal_conv1d_update_ref(x[keep], pool_ref, w, b, state_indices=padded[keep])
        close(f"update B={B} padding row: live outputs, pool {pool_dt}", out_p[keep], ref_p)
        check(f"update B={B} padding row: zeros, pool {pool_dt}", bool((out_p[B // 2] == 0).all()))
        exact(f"update B={B} padding row: pool, pool {pool_dt}", pool, pool_ref)


# --- timing -------------------------------------------------------------------------------------


def graph_us(fns: Sequence[Callable[[], object]]) -> float:
    """GPU µs per call: the calls captured back to back in one CUDA graph, replayed under do_bench
    (L2 flushed before each replay)."""
    if DRY:
        for f in fns:
            f()
        return 1.0
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    us = 1e3 * float(do_bench(graph.replay, warmup=10, rep=50, return_mode="median")) / len(fns)
    del graph
    return us


def eager_us(fns: Sequence[Callable[[], object]]) -> float:
    if DRY:
        fns[0]()
        return 1.0
    it = itertools.cycle(fns)
    return 1e3 * float(do_bench(lambda: next(it)(), warmup=10, rep=50, return_mode="median"))


def record(name: str, us: float, nbytes: float, copy_gbs: float, mode: str, **extra: Any) -> None:
    gbs = nbytes / us / 1e3
    rows.append(dict(name=name, mode=mode, us=us, gb_s=gbs, pct_copy=100 * gbs / copy_gbs, bytes=nbytes, **extra))
    print(f"{name:<52} {mode:<6} {us:8.2f} us {gbs:8.0f} GB/s {100 * gbs / copy_gbs:5.1f}% of copy", flush=True)


def copy_bandwidth() -> float:
    a = torch.randn(sz(128 * 2**20, 1024), device=DEV).to(ACT)  # 256 MB, read + written
    b = torch.empty_like(a)
    ms = 1.0 if DRY else float(do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median"))
    gbs = 2 * a.numel() * a.element_size() / ms / 1e6
    print(f"device copy: {gbs:.0f} GB/s (bytes read + written)", flush=True)
    return gbs


def time_varlen(g: torch.Generator, copy_gbs: float) -> None:
    w, b = conv_params(g)
    tiles = [VARLEN_TILE, ConvTile(32, 256, 1), ConvTile(8, 256, 1), ConvTile(16, 128, 1), ConvTile(16, 512, 2)]
    for lengths, tag in (([sz(2048, 40)], "1x2048"), ([sz(128, 8)] * sz(16, 3), "16x128 with history")):
        T, S, n_sets = sum(lengths), len(lengths), 4  # 4 x 43 MB of in_proj output: > 2 x L2
        cu = cu_of(lengths)
        xs = [xbc_of(g, T) for _ in range(n_sets)]
        pool = torch.randn(S * n_sets, CONV_DIM, WIDTH - 1, device=DEV, generator=g).to(ACT)
        idx = [torch.arange(i * S, (i + 1) * S, device=DEV, dtype=torch.int32) for i in range(n_sets)]
        init = torch.ones(S, dtype=torch.bool, device=DEV)
        nbytes = 2 * T * CONV_DIM * 2 + 2 * S * CONV_DIM * (WIDTH - 1) * 2  # x read, out written, states
        for tile in tiles if time.time() - T0 < SWEEP_UNTIL_S else [VARLEN_TILE]:
            fns = [partial(launch_conv_varlen, xs[i], w, b, pool, cu, idx[i], init, "silu", tile) for i in range(n_sets)]
            default = tile == VARLEN_TILE
            name = f"varlen {tag} tile={tuple(tile)}{' (default)' if default else ''}"
            record(name, graph_us(fns), nbytes, copy_gbs, "graph", tile=list(tile), default=default)
            if default:
                record(name, eager_us(fns), nbytes, copy_gbs, "eager", tile=list(tile), default=default)
        del xs, pool


def time_update(g: torch.Generator, copy_gbs: float) -> None:
    w, b = conv_params(g)
    n_calls = sz(32, 2)  # one graph of 32 calls, each on its own slots and x: every call starts cold
    for B in (1, 32, 128, 256) if not DRY else (1, 5):
        for pool_dt in (ACT, torch.float32):
            pool = torch.randn(n_calls * B, CONV_DIM, WIDTH - 1, device=DEV, generator=g).to(pool_dt)
            xs = [xbc_of(g, B) for _ in range(n_calls)]
            idx = [torch.arange(i * B, (i + 1) * B, device=DEV, dtype=torch.int32) for i in range(n_calls)]
            nbytes = B * CONV_DIM * (2 * (WIDTH - 1) * pool.element_size() + 2 * 2)  # state r+w, x, out
            default = default_update_tile(B)
            tiles = [default] if pool_dt != ACT else [default, *(t for t in (UpdateTile(128, 1), UpdateTile(256, 2),
                                                                          UpdateTile(1024, 4)) if t != default)]
            for tile in tiles if time.time() - T0 < SWEEP_UNTIL_S else [default]:
                fns = [partial(launch_conv_update, xs[i], pool, w, b, idx[i], "silu", tile) for i in range(n_calls)]
                is_default = tile == default
                name = (f"update B={B} pool {str(pool_dt).removeprefix('torch.')} tile={tuple(tile)}"
                        f"{' (default)' if is_default else ''}")
                record(name, graph_us(fns), nbytes, copy_gbs, "graph", tile=list(tile), default=is_default)
                if is_default:
                    record(name, eager_us(fns), nbytes, copy_gbs, "eager", tile=list(tile), default=is_default)
            del pool, xs


def main() -> int:
    g = torch.Generator(device=DEV).manual_seed(0)
    env = dict(device="dry run (CPU)" if DRY else torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, previous_us=PREVIOUS_US)
    copy_gbs = 0.0
    sections: list[tuple[str, Callable[[], None]]] = [
        *((f"check varlen {dt}", partial(check_varlen, g, dt)) for dt in (ACT, torch.float32)),
        *((f"check update {B} {dt}", partial(check_update, g, B, dt))
          for B in ((1, 32, 128) if not DRY else (1, 5)) for dt in (ACT, torch.float32)),
    ]
    for name, fn in sections:
        try:
            fn()
        except Exception:  # noqa: BLE001 -- a crash is a failed check, the other sections still run
            check(name, False, traceback.format_exc(limit=3))
    try:
        copy_gbs = copy_bandwidth()
        for timing in (time_varlen, time_update):
            timing(g, copy_gbs)
    except Exception:  # noqa: BLE001
        check("timings", False, traceback.format_exc(limit=3))
    failed = [c["name"] for c in checks if not c["ok"]]
    OUT.mkdir(parents=True, exist_ok=True)
    result = dict(env=env, copy_gb_s=copy_gbs, checks=checks, timings=rows, failed=failed,
                  wall_s=time.time() - T0)
    (OUT / "conv_gpu.json").write_text(json.dumps(result, indent=1))
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed; {time.time() - T0:.1f} s; "
          f"previous (replaced kernels, NOTES run 2): {PREVIOUS_US}; json: {OUT / 'conv_gpu.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
