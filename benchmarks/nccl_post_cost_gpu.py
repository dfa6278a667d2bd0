"""Host time of posting one NCCL p2p op (ProcessGroupNCCL.send / recv, the calls PeerGroup makes),
cuda:0 -> cuda:1, 32 MB messages, 200 back to back after a warm-up: per post, the median and
mean of the sender's `send` call and of the receiver's `recv` call (host wall time, the GPU not
waited for), under the environment given (e.g. TORCH_NCCL_TRACE_BUFFER_SIZE=0 to see what the
flight recorder costs a post).

    python benchmarks/nccl_post_cost_gpu.py     (2 GPUs)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N = 200


def run(rank: int, port: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    pg: Any = dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
    buf = torch.empty(32 << 20, dtype=torch.uint8, device=f"cuda:{rank}")
    times = []
    for i in range(N + 20):
        t0 = time.perf_counter()
        w = pg.send([buf], 1, 0) if rank == 0 else pg.recv([buf], 0, 0)
        t1 = time.perf_counter()
        w.wait()
        if i >= 20:
            times.append((t1 - t0) * 1e6)
    torch.cuda.synchronize()
    q.put((rank, statistics.median(times), statistics.mean(times), max(times)))
    pg.abort()


def main() -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps = [ctx.Process(target=run, args=(r, port, q)) for r in (0, 1)]
    for p in ps:
        p.start()
    out = sorted(q.get(timeout=120) for _ in ps)
    for p in ps:
        p.join(30)
    env = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL", "TORCH_FR", "NCCL_"))}
    for rank, med, mean, mx in out:
        print(f"{env or 'default env'}: {'send' if rank == 0 else 'recv'} post median {med:.1f} us, mean {mean:.1f}, max {mx:.0f}")


if __name__ == "__main__":
    main()
