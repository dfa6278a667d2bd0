"""What a small copy between two kernels costs the GPU: the decode step's boundary holds a few
(sampled tokens device -> host, the next step's inputs host -> device, the fed tokens device ->
device), and RESULTS.md session 21 found ~14-16 us of GPU idle there that no kernel accounts for.

A stream of 40 x [a ~10 us kernel, op], timed with events against 40 x [the kernel] alone; the
difference over 40 is what one op adds between kernels. Ops: copies of 256 bytes (device->device,
pinned host->device, device->pinned host), the same device->device copy as an elementwise kernel,
and a tiny Triton kernel. The host queues far ahead of the GPU (the kernel is long), so host time
is not what is measured.

    PYTHONPATH=. python3 benchmarks/step_boundary_gpu.py     (CUDA only; prints a table)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

REPS = 40


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def main() -> None:
    dev = torch.device("cuda")
    big = torch.randn(8 << 20, device=dev)  # 32 MB: a ~10-15 us read-modify kernel
    src = torch.randint(0, 1000, (32,), device=dev)  # 256 bytes of int64
    dst = torch.empty_like(src)
    host_in = torch.randint(0, 1000, (32,), dtype=torch.int64).pin_memory()
    host_out = torch.empty(32, dtype=torch.int64).pin_memory()

    def kernel() -> None:
        big.mul_(1.0000001)

    ops: dict[str, Callable[[], object]] = {
        "none": lambda: None,
        "D2D copy_ (memcpy)": lambda: dst.copy_(src),
        "H2D pinned copy_": lambda: dst.copy_(host_in, non_blocking=True),
        "D2H pinned copy_": lambda: host_out.copy_(src, non_blocking=True),
        "D2D as an add-0 kernel": lambda: torch.add(src, 0, out=dst),
        "Triton copy kernel": lambda: _copy_kernel[(1,)](src, dst, 32, BLOCK=32),
        "H2D + D2D + D2H": lambda: (dst.copy_(host_in, non_blocking=True), dst.copy_(src),
                                     host_out.copy_(src, non_blocking=True)),
    }
    for fn in ops.values():
        fn()
        kernel()
    torch.cuda.synchronize()
    res: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(5):
        for name, fn in ops.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            kernel()
            start.record()
            for _ in range(REPS):
                kernel()
                fn()
            end.record()
            end.synchronize()
            res[name].append(start.elapsed_time(end) * 1e3 / REPS)
    base = sorted(res["none"])[2]
    print(f"kernel alone: {base:.2f} us")
    for name, ts in res.items():
        med = sorted(ts)[2]
        print(f"  {name:36s} {med:8.2f} us a pair, +{med - base:6.2f} us")


if __name__ == "__main__":
    main()
