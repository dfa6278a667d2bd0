"""Host microseconds per call of the steps the NCCL connector takes per message (the device host's
CPU is what limits the connector, RESULTS.md session 7): each step called N times in a loop, the
device synchronized only around the loop, so the figure is host time (queueing), not device time.

    python benchmarks/host_costs_gpu.py      # two processes on cuda:0 / cuda:1; a table on stdout
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N = 200


def _per_call(fn: Callable[[], Any], dev: torch.device, n: int = N) -> float:
    fn()
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize(dev)
    return 1e6 * (t1 - t0) / n


def local(dev: torch.device) -> dict[str, float]:
    from pd_ssm.state_transfer.block_sums_triton import _block_sums_kernel, block_sums_triton
    from pd_ssm.state_transfer.nccl_pinned import PinnedPool

    buf = torch.randint(0, 255, (86 << 20,), dtype=torch.uint8, device=dev)
    small = buf[: 16 * (64 << 10)]
    out = torch.empty(small.numel() // (64 << 10), dtype=torch.int64, device=dev)
    side = torch.cuda.Stream(dev)
    pool = PinnedPool()
    host = pool.take(4096)
    res: dict[str, float] = {}
    res["torch.empty 86 MB"] = _per_call(lambda: torch.empty(86 << 20, dtype=torch.uint8, device=dev), dev)
    res["zero_ 64 KiB"] = _per_call(lambda: small[: 64 << 10].zero_(), dev)
    res["triton block_sums (jit launch)"] = _per_call(lambda: block_sums_triton(small, out=out), dev)
    compiled = _block_sums_kernel[(out.numel(),)](small.view(torch.int32), out, out, out.numel(),
                                                  WORDS=16384, CHUNK=1024, COPY_THEIRS=False, num_warps=4)
    args = (small.view(torch.int32), out, out, out.numel(), 16384, 1024, False)
    launch = compiled[(out.numel(), 1, 1)]
    res["triton block_sums (compiled launch)"] = _per_call(lambda: launch(*args), dev)

    def ctx() -> None:
        with torch.cuda.stream(side):
            pass

    res["with torch.cuda.stream(side)"] = _per_call(ctx, dev)
    res["copy_ to pinned (non_blocking)"] = _per_call(lambda: host[: out.numel()].copy_(out, non_blocking=True), dev)
    res["record_event"] = _per_call(lambda: torch.cuda.current_stream(dev).record_event(), dev)
    res["record_stream"] = _per_call(lambda: buf.record_stream(side), dev)
    res["_foreach_copy_ 2 x 1 MB"] = _per_call(
        lambda: torch._foreach_copy_([buf[: 1 << 20], buf[1 << 20 : 2 << 20]], [buf[4 << 20 : 5 << 20], buf[5 << 20 : 6 << 20]]), dev)
    res["uint8 slice + view"] = _per_call(lambda: buf[1 << 16 : 2 << 16].view(torch.float32).view(4, 4096), dev)
    return res


def p2p(rank: int, port: int, rq: Any) -> None:
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    res = local(dev) if rank == 0 else {}
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60), device_id=dev)
    grp = dist.new_group([0, 1])
    msg = torch.ones(1 << 16, dtype=torch.uint8, device=dev)
    for _ in range(3):
        (grp.send([msg], 1, 0) if rank == 0 else grp.recv([msg], 0, 0)).wait()
    torch.cuda.synchronize(dev)
    n = 100
    dist.barrier()
    t0 = time.perf_counter()
    works = [grp.send([msg], 1, 0) if rank == 0 else grp.recv([msg], 0, 0) for _ in range(n)]
    t1 = time.perf_counter()
    for w in works[:-1]:
        w.wait()
    t2 = time.perf_counter()
    works[-1].wait()
    torch.cuda.synchronize(dev)
    res["p2p post (send / recv), 64 KiB"] = 1e6 * (t1 - t0) / n
    res["work.wait() (stream wait)"] = 1e6 * (t2 - t1) / (n - 1)
    done = _per_call(lambda: works[0].is_completed(), dev)
    res["work.is_completed()"] = done
    dist.barrier()
    dist.destroy_process_group()
    rq.put((rank, res))


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    rq = ctx.Queue()
    procs = [ctx.Process(target=p2p, args=(r, port, rq)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(rq.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    for rank in (0, 1):
        for k, v in got[rank].items():
            print(f"rank {rank}  {k:40} {v:8.1f} us")


if __name__ == "__main__":
    main()
