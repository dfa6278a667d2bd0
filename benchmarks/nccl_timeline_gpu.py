"""The NCCL connector's timeline on both GPUs: where 8 requests back to back (and one alone) spend
their time, cuda:0 -> cuda:1, from torch.profiler traces of both processes.

`bench transfer` says how far the connector is from the raw one-message send; nccl_overhead_gpu.py
splits the host's share. This one shows the device side next to the host's: each rank's kernels
(layout copies, block sums, the NCCL send/recv kernel), the gaps between them, and the connector
steps (record_function ranges around the same methods nccl_overhead_gpu.py times), in ms after the
run's barrier on that rank.

    python benchmarks/nccl_timeline_gpu.py      # summary on stdout; $OUT/timeline_rank{0,1}.json
    (env DTYPE=float32 for fp32 pages, CAP=<bytes> for another coalescing cap)

Runs: raw8 (8 raw one-message sends), x1 / x8 (1 / 8 whole requests back to back) and s8 (8
requests streamed layer by layer: `send_layers` per layer, then the final `send`, as a streaming
prefill worker hands them over), each summarized as its rows and as totals per step and kernel.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKEN = "timeline"
RUNS = 4  # the last one is summarized; the ones before warm up


def _wrap_steps(rank: int) -> None:
    """record_function ranges around the connector's steps (they show as user annotations)."""
    from torch.profiler import record_function

    from pd_ssm.state_transfer import nccl_batch, nccl_inbound, nccl_receiver, nccl_sender

    def wrap(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def ranged(*a: Any, **k: Any) -> Any:
            with record_function(label):
                return fn(*a, **k)

        setattr(owner, name, ranged)

    if rank == 0:
        wrap(nccl_batch, "build", "step:build")
        wrap(nccl_batch, "fill", "step:layout")
        wrap(nccl_sender.NcclSender, "_dispatch", "step:dispatch")
        wrap(nccl_sender.NcclSender, "_check_dropped", "step:probe")
        wrap(nccl_sender.NcclSender, "flush", "step:flush")
    else:
        wrap(nccl_receiver.NcclReceiver, "_read", "step:read")
        wrap(nccl_receiver.NcclReceiver, "_wait", "step:wait")
        wrap(nccl_receiver.NcclReceiver, "_finish", "step:finish")
        wrap(nccl_inbound.Inbound, "block_sums", "step:block_sums")
        wrap(nccl_receiver, "unpack_runs", "step:unpack")


def run(rank: int, port: int, q: Any, rq: Any, out: Path) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    from pd_ssm.bench.transfer import PageShape, make_pages, renamed
    from pd_ssm.cache.pages import PageRun, StatePages
    from pd_ssm.state_transfer.base import Ticket
    from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector
    from pd_ssm.state_transfer.reservations import ReservationTable

    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    dtype = getattr(torch, os.environ.get("DTYPE", "bfloat16"))
    table = ReservationTable(ttl=600, token=TOKEN)
    if rank == 1:
        conn = NcclConnector(NcclConfig(TOKEN, "tcp://127.0.0.1:0", device=str(dev), timeout=60),
                             bind="tcp://127.0.0.1:0", reservations=table)
        q.put(conn.rendezvous)
        while not conn.paired:
            conn.recv(timeout=0.05)
    else:
        conn = NcclConnector(NcclConfig(TOKEN, q.get(), device=str(dev), timeout=60, send_timeout=60,
                                        stream_layers=True))
        if "CAP" in os.environ:
            assert conn._tx is not None
            conn._tx._held.cap = int(os.environ["CAP"])
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    host = make_pages("t", "mamba2", dtype, PageShape())
    assert host.runs is not None
    pages = StatePages(host.request, runs=[PageRun(r.kind, r.name, r.layers, r.stacked.to(dev)) for r in host.runs])
    flat = torch.cat([r.stacked.reshape(-1).view(torch.uint8) for r in pages.runs or []])
    layers = list(pages.layers.values())  # per-layer views, as the engine's LayerExporter hands them
    n = [0]

    def batch(count: int) -> None:
        ids = [f"r{n[0] + j}" for j in range(count)]
        n[0] += count
        if rank == 0:
            assert conn.address is not None
            for rid in ids:
                conn.send(renamed(pages, rid), Ticket(rid, conn.address, 0, [], time.monotonic() + 600, TOKEN))
            assert conn.flush(60)
        else:
            for _ in ids:
                assert conn.recv(timeout=60) is not None

    def streamed(count: int) -> None:
        if rank == 1:
            batch(count)
            return
        ids = [f"r{n[0] + j}" for j in range(count)]
        n[0] += count
        assert conn.address is not None
        for rid in ids:
            ticket = Ticket(rid, conn.address, 0, [], time.monotonic() + 600, TOKEN)
            for layer in layers:
                conn.send_layers(ticket, [layer])
            conn.send(StatePages(dataclasses.replace(pages.request, req_id=rid)), ticket)
        assert conn.flush(60)

    def raw(count: int) -> None:
        for _ in range(count):
            if rank == 0:
                dist.send(flat, 1)
            else:
                dist.recv(flat, 0)

    if rank == 1:
        for i in range(RUNS * 17):
            table.reserve(f"r{i}", conn.address or "", slot=0)
    _wrap_steps(rank)
    wall: dict[str, float] = {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for label, fn, count in (("raw8", raw, 8), ("x1", batch, 1), ("x8", batch, 8), ("s8", streamed, 8)):
            for i in range(RUNS):
                dist.barrier()
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                with record_function(f"run:{label}:{i}"):
                    fn(count)
                    torch.cuda.synchronize(dev)
                wall[f"{label}:{i}"] = 1e3 * (time.perf_counter() - t0)
    path = out / f"timeline_rank{rank}.json"
    prof.export_chrome_trace(str(path))
    dist.barrier()
    conn.close()
    dist.destroy_process_group()
    rq.put((rank, str(path), wall, flat.numel()))


def summarize(path: str, rank: int, label: str) -> list[str]:
    """The last run of `label`: every GPU kernel / copy and every connector step, ms after its start."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    run = [e for e in spans if e.get("name") == f"run:{label}:{RUNS - 1}"]
    if not run:
        return [f"rank {rank}: no run:{label} range in the trace"]
    t0, t1 = run[0]["ts"], run[0]["ts"] + run[0]["dur"]
    rows = []
    for e in spans:
        if not t0 <= e["ts"] <= t1:
            continue
        cat = e.get("cat", "")
        name = str(e.get("name", ""))
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            rows.append((e["ts"], f"  gpu  {(e['ts'] - t0) / 1e3:7.3f} +{e['dur'] / 1e3:6.3f}  {name[:70]}"))
        elif cat == "user_annotation" and name.startswith("step:"):
            rows.append((e["ts"], f"  host {(e['ts'] - t0) / 1e3:7.3f} +{e['dur'] / 1e3:6.3f}  {name}"))
        elif cat == "cuda_runtime" and "Synchronize" in name and e["dur"] > 20:
            rows.append((e["ts"], f"  host {(e['ts'] - t0) / 1e3:7.3f} +{e['dur'] / 1e3:6.3f}  {name}"))
    lines = [f"rank {rank} run:{label} (last of {RUNS}): {(t1 - t0) / 1e3:.3f} ms"]
    lines += [line for _, line in sorted(rows)][:120]
    totals: dict[str, list[float]] = {}
    for e in spans:
        name, cat = str(e.get("name", "")), e.get("cat", "")
        if t0 <= e["ts"] <= t1 and (cat in ("kernel", "gpu_memcpy", "gpu_memset")
                                    or cat == "user_annotation" and name.startswith("step:")):
            key = ("gpu  " if cat != "user_annotation" else "host ") + name[:60]
            totals.setdefault(key, []).append(e["dur"] / 1e3)
    lines.append(f"rank {rank} run:{label} totals (ms, count):")
    lines += [f"  {k:66} {sum(v):8.3f} {len(v):5d}" for k, v in sorted(totals.items(), key=lambda kv: -sum(kv[1]))]
    return lines


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q, rq = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, port, q, rq, out)) for r in (1, 0)]
    for p in procs:
        p.start()
    got = {r: (path, wall, nbytes) for r, path, wall, nbytes in (rq.get(timeout=300) for _ in procs)}
    for p in procs:
        p.join(30)
    nbytes = got[1][2]
    print(f"pages {os.environ.get('DTYPE', 'bfloat16')}: {nbytes / 1e6:.1f} MB a request")
    for rank in (0, 1):
        wall = got[rank][1]
        print(f"rank {rank} wall ms:", " ".join(f"{k}={v:.3f}" for k, v in wall.items()))
    for label in ("raw8", "x1", "x8", "s8"):
        for rank in (0, 1):
            print("\n".join(summarize(got[rank][0], rank, label)))


if __name__ == "__main__":
    main()
