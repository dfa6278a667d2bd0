"""What the hand-off between two dependent launches costs, and whether a readiness count beats the PDL
gate: a chain of launches in one CUDA graph, each reading its predecessor's output.

The batch-1 decode step is 3 launches a layer (in_proj + conv, state update, out_proj + add), each
waiting in `griddepcontrol.wait` for the whole grid before it to complete (pdl.py). The other way
to wait: each program of a launch adds 1 to a count in global memory (release) after its stores,
and the next launch's programs, released at their start, spin until the count reaches the grid
size (acquire). Three counts in a ring: launch i adds to slot i % 3, waits on slot (i - 1) % 3 and
resets slot (i + 1) % 3, which launch i - 1 waited on and launch i + 1 adds to.

Chains (one CUDA graph each, µs a link or a layer, median of 7 replays):
  tiny        192 launches of G programs that only read their predecessor's 64 values
  layer       64 x [331 programs streaming 164 KB of bf16 each (in_proj's 54 MB), 320 programs of
              8 KB (the state update's 2.6 MB), 640 of 41 KB (out_proj's 26 MB)], distinct buffers
Modes: plain launches (no PDL), the PDL gate, the count (released after the wait, as the gate; or
`count-early`: released at the start, so launches run ahead as far as the SMs hold them). The last values of each chain are compared
between modes: a count that let a launch read early would show there.

    PYTHONPATH=. python3 benchmarks/handoff_gpu.py     (CUDA only; prints a table)
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from benchmarks.linear_gpu import graph_time_us

# count: poll with an acquiring atomic; count-ld: poll with volatile loads, then one acquiring atomic;
# (mode 4, released at the start, ran ahead of the ring of three counts and hung: not timed)
MODES = {"plain": 0, "gate": 1, "count": 2, "count-ld": 3}
BLOCK = 2048


@triton.jit
def _link_kernel(w_ptr, x_ptr, y_ptr, cnt_ptr, prev_slot, my_slot, reset_slot, prev_grid,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if MODE >= 2:
        if MODE == 4:
            tl.extra.cuda.gdc_launch_dependents()
        if MODE == 3:
            v = tl.load(cnt_ptr + prev_slot, volatile=True)
            while v < prev_grid:
                v = tl.load(cnt_ptr + prev_slot, volatile=True)
        c = tl.atomic_add(cnt_ptr + prev_slot, 0, sem="acquire", scope="gpu")
        while c < prev_grid:
            c = tl.atomic_add(cnt_ptr + prev_slot, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        if MODE != 4:
            tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + pid % 64)  # the predecessor's output
    total = x
    if CHUNK > 0:
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        base = w_ptr + pid.to(tl.int64) * CHUNK
        for k in tl.range(0, CHUNK, BLOCK, num_stages=NUM_STAGES):
            acc += tl.load(base + k + offs).to(tl.float32)
        total += tl.sum(acc, axis=0) * 1e-3
    tl.store(y_ptr + pid, total * 0.5 + 1.0)
    if MODE >= 2:
        if pid == 0:
            tl.atomic_xchg(cnt_ptr + reset_slot, 0, sem="relaxed", scope="gpu")
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + my_slot, 1, sem="release", scope="gpu")


class Link(NamedTuple):
    grid: int
    chunk: int  # bf16 elements a program streams


def run_chain(links: list[Link], mode: int | list[int], dev: torch.device,
              ws: list[torch.Tensor | None]) -> tuple[float, float]:
    """(median µs for the chain, its last output's sum); `mode`: one for every link, or one a link."""
    modes = mode if isinstance(mode, list) else [mode] * len(links)
    ys = [torch.empty(max(64, ln.grid), device=dev) for ln in links]
    x0 = torch.rand(64, device=dev)
    cnt = torch.zeros(3, dtype=torch.int32, device=dev)
    init = torch.tensor([0, 0, 1], dtype=torch.int32, device=dev)

    def chain() -> None:
        cnt.copy_(init)
        prev, prev_grid = x0, 1
        for i, (ln, w, y, m) in enumerate(zip(links, ws, ys, modes, strict=True)):
            # mode -1: compiled with the gate, launched without the PDL attribute
            opts = {"launch_pdl": True} if m > 0 else {}
            _link_kernel[(ln.grid,)](w if w is not None else y, prev, y, cnt, (i - 1) % 3, i % 3, (i + 1) % 3,
                                     prev_grid, CHUNK=ln.chunk, BLOCK=BLOCK, MODE=abs(m), NUM_STAGES=3, **opts)
            prev, prev_grid = y, ln.grid

    t = graph_time_us(lambda _x, _w: chain(), None, [0])
    return t, float(ys[-1][: links[-1].grid].double().sum())


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print("mode      chain                 us total   us a link/layer   last sum", flush=True)
    quick = os.environ.get("HANDOFF_TINY", "1") == "1"
    for grid in (80, 132, 331, 640) if quick else ():
        links = [Link(grid, 0)] * 192
        for name, mode in MODES.items():
            t, s = run_chain(links, mode, dev, [None] * len(links))
            print(f"{name:8s}  tiny x192 grid {grid:4d}   {t:9.1f}   {t / 192:8.2f}          {s:.6e}", flush=True)
    # in_proj's 54 MB over other grids (2 / 3 / 5 programs a SM and 331 as the GEMV's tiles)
    for in_grid in (331, 660):
        layer = [Link(in_grid, 331 * 81920 // in_grid // BLOCK * BLOCK), Link(320, 4096), Link(640, 20480)]
        links = layer * 64
        ws: list[torch.Tensor | None] = [torch.randn(ln.grid * ln.chunk, device=dev, dtype=torch.bfloat16)
                                         for ln in links]
        byts = sum(ln.grid * ln.chunk * 2 for ln in links)
        runs: list[tuple[str, int | list[int]]] = [("plain", 0), ("gate", 1), ("in plain, rest gate", [-1, 1, 1] * 64),
                                                   ("in+out plain, ssu gate", [-1, 1, -1] * 64)]
        for _ in range(2):
            for name, modes in runs:
                t, s = run_chain(links, modes, dev, ws)
                print(f"{name:8s}  layer x64, in {in_grid:3d}    {t:9.1f}   {t / 64:8.2f} "
                      f"({byts / t / 1e6:.2f} TB/s)   {s:.6e}", flush=True)
        del ws
    # the same bytes in one launch a kernel kind (no hand-offs inside a layer's stream)
    for ln in (Link(331, 81920), Link(320, 4096), Link(640, 20480)):
        w = torch.randn(ln.grid * ln.chunk * 64, device=dev, dtype=torch.bfloat16)
        t, _ = run_chain([Link(ln.grid * 64, ln.chunk)], 1, dev, [w])
        print(f"one launch, {ln.grid * 64} programs of {ln.chunk * 2 // 1024} KB: {t:.1f} us "
              f"({ln.grid * 64 * ln.chunk * 2 / t / 1e6:.2f} TB/s)")
    src = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    print(f"copy bandwidth (read + write): {2 * src.numel() * 10 / (start.elapsed_time(end) * 1e-3) / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
