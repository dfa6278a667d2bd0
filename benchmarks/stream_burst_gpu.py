"""Where the NCCL connector's streamed burst (`bench transfer`'s nccl-stream row) spends its time.

8 Mamba2-2.7B requests (fp32 state, 169.8 MB each) streamed cuda:0 -> cuda:1 as `transfer_p2p`'s
streamed run does (`send_layers`, then the final `send`), under several part sizes and layers per
`send_layers` call, next to the same requests sent whole and a raw one-message send/recv. Per
variant, medians of RUNS runs: the receiver's time from the barrier to the last request checked
(-> ratio to raw), the sender's host time handing the burst over (the send_layers / send calls),
its time in flush after that, the data messages it posted, and the receiver's host time inside
`_read` (parse, allocate, post the recv) and `_finish` (wait, check, unpack).

    python benchmarks/stream_burst_gpu.py     (2 GPUs; JSON to $OUT/stream_burst.json)
"""

from __future__ import annotations

import cProfile
import dataclasses
import io
import json
import multiprocessing as mp
import os
import pstats
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_ssm.bench.transfer import TOKEN, PageShape, make_pages, renamed  # noqa: E402
from pd_ssm.bench.transfer_p2p import _join_default_group  # noqa: E402
from pd_ssm.cache.pages import PageRun, StatePages  # noqa: E402

N, RUNS, TIMEOUT = 8, 4, 120.0
DEVICE = os.environ.get("DEVICE", "cuda")  # cpu: gloo and tiny pages (a smoke test of this script)
MB = 1 << 20
# (label, stream_bytes or 0 for whole sends, layers per send_layers call, NcclConfig.part_hold)
VARIANTS = [("whole", 0, 0, 0.0), ("stream 32M x1 no hold", 32 * MB, 1, 0.0), ("stream 32M x1", 32 * MB, 1, 2e-3),
            ("stream 32M x8", 32 * MB, 8, 2e-3), ("stream 256M x1", 256 * MB, 1, 2e-3), ("whole (again)", 0, 0, 0.0),
            ("stream 32M x1 no hold (again)", 32 * MB, 1, 0.0), ("stream 32M x1 (again)", 32 * MB, 1, 2e-3)]


def _dev(rank: int) -> torch.device:
    if DEVICE == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    return torch.device(f"cuda:{rank}")


def _shape() -> PageShape:
    return PageShape() if DEVICE == "cuda" else dataclasses.replace(PageShape.tiny(), layers=64)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _profiled(label: str) -> cProfile.Profile | None:
    """env PROFILE=<label>: that variant's timed runs under cProfile (printed by `_report`)."""
    return cProfile.Profile() if os.environ.get("PROFILE") == label else None


def _report(prof: cProfile.Profile | None, role: str) -> None:
    if prof is None:
        return
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"prof_{role}.txt").write_text(f"{role}, {os.environ.get('PROFILE')}, {RUNS} runs\n{text.getvalue()}")


class Clock:
    """Host seconds spent inside wrapped methods, and their calls."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.n: dict[str, int] = {}

    def wrap(self, owner: Any, name: str) -> None:
        fn = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t0
                self.n[name] = self.n.get(name, 0) + 1

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out = {f"{k}_ms": v * 1e3 for k, v in self.s.items()} | {f"{k}_calls": float(v) for k, v in self.n.items()}
        self.s, self.n = {}, {}
        return out


def _sender(port: int, q: Any, out: Any) -> None:
    from pd_ssm.state_transfer.base import Ticket
    from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector
    from pd_ssm.state_transfer.nccl_sender import NcclSender

    dev = _dev(0)
    clock = Clock()
    clock.wrap(NcclSender, "_dispatch")
    host = make_pages("b", "mamba2", torch.float32, _shape())
    assert host.runs is not None
    runs = [PageRun(r.kind, r.name, r.layers, r.stacked.to(dev)) for r in host.runs]
    pages = StatePages(host.request, runs=runs)
    flat = torch.cat([r.stacked.reshape(-1).view(torch.uint8) for r in runs])
    tx = NcclConnector(NcclConfig(TOKEN, q.get(timeout=TIMEOUT), device=str(dev), timeout=TIMEOUT,
                                  send_timeout=TIMEOUT, stream_layers=True))
    _join_default_group(DEVICE, 0, port, TIMEOUT)
    for _ in range(RUNS + 1):
        dist.barrier()
        dist.send(flat, dst=1)
        _sync(dev)
    assert tx.address is not None
    layers = list(StatePages(host.request, runs=runs).layers.values())
    figures: dict[str, list[dict[str, float]]] = {}
    for label, stream_bytes, per_call, hold in VARIANTS:
        prof = _profiled(label)
        for i in range(RUNS + 1):
            dist.barrier()
            clock.take()
            if prof is not None and i:
                prof.enable()
            t0 = time.perf_counter()
            for j in range(N):
                rid = f"{label}-{i}-{j}"
                ticket = Ticket(rid, tx.address, 0, [], time.monotonic() + TIMEOUT, TOKEN)
                if stream_bytes == 0:
                    tx.send(renamed(pages, rid), ticket)
                    continue
                tx.config.stream_bytes, tx.config.part_hold = stream_bytes, hold
                for k in range(0, len(layers), per_call):
                    tx.send_layers(ticket, layers[k:k + per_call])
                tx.send(StatePages(dataclasses.replace(host.request, req_id=rid)), ticket)
            t1 = time.perf_counter()
            if not tx.flush(TIMEOUT):
                raise RuntimeError(f"{label}: sends did not complete: {tx.get_failed()}")
            t2 = time.perf_counter()
            if prof is not None:
                prof.disable()
            if i:
                figures.setdefault(label, []).append({"handover_ms": (t1 - t0) * 1e3, "flush_ms": (t2 - t1) * 1e3}
                                                     | clock.take())
        _report(prof, "sender")
    dist.barrier()
    out.put(figures)
    tx.close()
    dist.destroy_process_group()


def _receiver(port: int, q: Any, out: Any) -> None:
    from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector
    from pd_ssm.state_transfer.nccl_receiver import NcclReceiver
    from pd_ssm.state_transfer.reservations import ReservationTable

    dev = _dev(1)
    clock = Clock()
    clock.wrap(NcclReceiver, "_read")
    clock.wrap(NcclReceiver, "_finish")
    nbytes = make_pages("b", "mamba2", torch.float32, _shape()).nbytes()
    table = ReservationTable(ttl=TIMEOUT, token=TOKEN)
    rx = NcclConnector(NcclConfig(TOKEN, "tcp://127.0.0.1:0", device=str(dev), timeout=TIMEOUT),
                       bind="tcp://127.0.0.1:0", reservations=table)
    q.put(rx.rendezvous)
    end = time.monotonic() + TIMEOUT
    while not rx.paired and time.monotonic() < end:
        rx.recv(timeout=0.05)
    _join_default_group(DEVICE, 1, port, TIMEOUT)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    raw = []
    for _ in range(RUNS + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.recv(buf, src=0)
        _sync(dev)
        raw.append(time.perf_counter() - t0)
    figures: dict[str, Any] = {"raw_ms": statistics.median(raw[1:]) * 1e3, "nbytes": nbytes}
    for label, *_ in VARIANTS:
        prof = _profiled(label)
        for i in range(RUNS + 1):
            ids = [f"{label}-{i}-{j}" for j in range(N)]
            for rid in ids:
                table.reserve(rid, rx.address or "", slot=0)
            dist.barrier()
            clock.take()
            if prof is not None and i:
                prof.enable()
            t0 = time.perf_counter()
            got = [rx.recv(timeout=TIMEOUT) for _ in ids]
            _sync(dev)
            t1 = time.perf_counter()
            if prof is not None:
                prof.disable()
            if any(g is None for g in got):
                raise RuntimeError(f"{label}: a request did not arrive: {rx.get_failed()}")
            if i:
                figures.setdefault(label, []).append({"total_ms": (t1 - t0) * 1e3} | clock.take())
        _report(prof, "receiver")
    dist.barrier()
    out.put(figures)
    rx.close()
    dist.destroy_process_group()


def main() -> None:
    ctx = mp.get_context("spawn")
    q, rs, ss = ctx.Queue(), ctx.Queue(), ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_receiver, args=(port, q, rs)), ctx.Process(target=_sender, args=(port, q, ss))]
    for p in procs:
        p.start()
    rx, tx = rs.get(timeout=600), ss.get(timeout=600)
    for p in procs:
        p.join(30)
    raw_ms, nbytes = rx.pop("raw_ms"), rx.pop("nbytes")
    print(f"raw one message {nbytes / 1e6:.1f} MB: {raw_ms:.3f} ms ({nbytes / raw_ms / 1e6:.0f} GB/s); {N} requests a run")
    rows = []
    for label, *_ in VARIANTS:
        def med(side: list[dict[str, float]], key: str) -> float:
            return statistics.median(r.get(key, 0.0) for r in side)
        r, t = rx[label], tx[label]
        row = {"variant": label, "ratio": N * raw_ms / med(r, "total_ms")}
        row |= {f"rx_{k}": med(r, k) for k in r[0]} | {f"tx_{k}": med(t, k) for k in t[0]}
        rows.append(row)
        print(f"{label:24} ratio {row['ratio']:.2f}  rx total {row['rx_total_ms']:6.2f} ms  tx handover "
              f"{row['tx_handover_ms']:6.2f} flush {row['tx_flush_ms']:6.2f}  messages {row.get('tx__dispatch_calls', 0):3.0f} "
              f"dispatch {row.get('tx__dispatch_ms', 0):6.2f} ms  rx read {row.get('rx__read_ms', 0):5.2f} "
              f"finish {row.get('rx__finish_ms', 0):6.2f} ms ({row.get('rx__finish_calls', 0):.0f} calls)", flush=True)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "stream_burst.json").write_text(json.dumps({"raw_ms": raw_ms, "nbytes": nbytes, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
