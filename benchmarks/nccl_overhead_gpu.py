"""Where the NCCL connector's per-request time goes, cuda:0 -> cuda:1, one 168 MB request at a time:

  raw_default   dist.send / dist.recv on the default group, one reused buffer (bench's baseline)
  raw_peer      isend / irecv on a PeerGroup (the connector's private group), reused buffers
  raw_peer_new  the same with a fresh buffer each time on both sides (what the connector allocates)
  connector     NcclConnector.send + flush / recv (pack, checksums, metadata over ZMQ)
  connector_x8  8 requests back to back (coalesced: the first alone, the rest in messages of up to
                coalesce_bytes, 512 MB); connector_x8_<variant> the same with another cap (1: one
                request a message) or bf16 state pages (86 MB a request); env X8_CAPS
                ("bf16:1,fp32:180000000,...") names the variants instead
  phases        the connector's receive split: control read -> recv posted -> bytes in -> checked

    python benchmarks/nccl_overhead_gpu.py      # prints medians (ms), writes $OUT/nccl_overhead.json
"""

from __future__ import annotations

import json
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

N = 169_836_544
REPS = 12
TOKEN = "overhead"


def _timed(fn: Any, dev: torch.device) -> list[float]:
    out = []
    for _ in range(REPS + 2):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        out.append(time.perf_counter() - t0)
    return out[2:]


def run(rank: int, port: int, q: Any, rq: Any) -> None:
    from pd_ssm.bench.transfer import PageShape, make_pages
    from pd_ssm.state_transfer.base import Ticket
    from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector
    from pd_ssm.state_transfer.nccl_group import PeerGroup
    from pd_ssm.state_transfer.reservations import ReservationTable

    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    res: dict[str, list[float]] = {}
    if rank == 1:
        table = ReservationTable(ttl=600, token=TOKEN)
        conn = NcclConnector(NcclConfig(TOKEN, "tcp://127.0.0.1:0", device=str(dev), timeout=60), bind="tcp://127.0.0.1:0",
                             reservations=table)
        q.put(conn.rendezvous)
        while not conn.paired:
            conn.recv(timeout=0.05)
    else:
        conn = NcclConnector(NcclConfig(TOKEN, q.get(), device=str(dev), timeout=60, send_timeout=60))
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    buf = torch.randint(0, 255, (N,), dtype=torch.uint8, device=dev)
    res["raw_default"] = _timed(lambda: dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0), dev)
    grp: PeerGroup = (conn._tx or conn._rx)._group  # type: ignore[union-attr]

    def peer(fresh: bool) -> None:
        b = torch.empty(N, dtype=torch.uint8, device=dev) if fresh else buf
        w = grp.isend(b) if rank == 0 else grp.irecv(b)
        assert grp.wait(w, 60) is None

    res["raw_peer"] = _timed(lambda: peer(False), dev)
    res["raw_peer_new"] = _timed(lambda: peer(True), dev)
    bufs = [torch.empty(N, dtype=torch.uint8, device=dev) for _ in range(8)]

    def peer8() -> None:  # 8 messages back to back, all posted at once
        works = [grp.isend(b) if rank == 0 else grp.irecv(b) for b in bufs]
        assert all(grp.wait(w, 60) is None for w in works)

    res["raw_peer_x8"] = _timed(peer8, dev)
    from pd_ssm.cache.pages import PageRun, StatePages

    host = make_pages("o", "mamba2", torch.float32, PageShape())
    assert host.runs is not None
    pages = StatePages(host.request, runs=[PageRun(r.kind, r.name, r.layers, r.stacked.to(dev)) for r in host.runs])
    n = [0]

    def connector() -> None:
        rid = f"c{n[0]}"
        n[0] += 1
        if rank == 0:
            from pd_ssm.bench.transfer import renamed

            assert conn.address is not None
            conn.send(renamed(pages, rid), Ticket(rid, conn.address, 0, [], time.monotonic() + 600, TOKEN))
            assert conn.flush(60)
        else:
            assert conn.recv(timeout=60) is not None

    if rank == 1:  # reservations for every connector run, made before the barriers
        for i in range(REPS + 2):
            table.reserve(f"c{i}", conn.address or "", slot=0)
    marks = _instrument(rank)
    res["connector"] = _timed(connector, dev)
    res.update(_phases(marks))
    marks.clear()

    x8_pages = [pages]  # what connector8 sends (the variants below swap it)

    def connector8() -> None:
        if rank == 0:
            from pd_ssm.bench.transfer import renamed

            assert conn.address is not None
            for _ in range(8):
                rid = f"c{n[0]}"
                n[0] += 1
                conn.send(renamed(x8_pages[0], rid), Ticket(rid, conn.address, 0, [], time.monotonic() + 600, TOKEN))
            assert conn.flush(60)
        else:
            for _ in range(8):
                assert conn.recv(timeout=60) is not None

    if rank == 1:
        for i in range(REPS + 2, (REPS + 2) * 9):
            table.reserve(f"c{i}", conn.address or "", slot=0)
    res["connector_x8"] = _timed(connector8, dev)
    tot: dict[str, float] = {}
    starts: dict[str, float] = {}
    for label, t in marks:  # host time inside each wrapped step, summed over the x8 runs
        name, _, edge = label.rpartition(".")
        if edge == "start":
            starts[name] = t
        elif edge == "end" and name in starts:
            tot[name] = tot.get(name, 0.0) + t - starts.pop(name)
    res.update({f"x8_total:{k}": [v / (REPS + 2)] for k, v in tot.items()})
    marks.clear()
    # the same 8 back to back with other coalescing caps (1: one request a message) and bf16 state
    # (half the bytes for the same host work): which cap keeps the link busiest
    bf16 = make_pages("o", "mamba2", torch.bfloat16, PageShape())
    assert bf16.runs is not None
    bf16_pages = StatePages(bf16.request, runs=[PageRun(r.kind, r.name, r.layers, r.stacked.to(dev)) for r in bf16.runs])
    first = (REPS + 2) * 9  # the next request id number, the same on both ranks
    default_cap = 512 << 20
    variants = [("one_per_message", pages, 1), ("cap256MB", pages, 256 << 20),
                ("cap1GB", pages, 1 << 30), ("bf16", bf16_pages, default_cap),
                ("bf16_one_per_message", bf16_pages, 1), ("bf16_cap256MB", bf16_pages, 256 << 20)]
    if os.environ.get("X8_CAPS"):  # e.g. "bf16:1,bf16:180000000,fp32:512000000": these instead
        variants = [(f"{d}_cap{c}", bf16_pages if d == "bf16" else pages, int(c))
                    for d, c in (v.split(":") for v in os.environ["X8_CAPS"].split(","))]
    for label, variant, cap in variants:
        x8_pages[0] = variant
        if rank == 0:
            assert conn._tx is not None
            conn._tx._held.cap = cap
        else:
            for i in range(first, first + (REPS + 2) * 8):
                table.reserve(f"c{i}", conn.address or "", slot=0)
        first += (REPS + 2) * 8
        res[f"connector_x8_{label}"] = _timed(connector8, dev)
    if rank == 0:
        conn._tx._held.cap = default_cap  # type: ignore[union-attr]
    if rank == 0:
        # sender phases, one request: plan (metadata) / buffer laid out with its sums trailer
        # (queued) / the device done / one more block-sum pass, queued and on the host
        from pd_ssm.state_transfer.nccl_checksum import PendingSums
        from pd_ssm.state_transfer.nccl_message import fill, plan

        ph: dict[str, list[float]] = {"plan": [], "fill": [], "fill_on_device": [], "sums_queued": [],
                                      "sums_on_host": []}
        for _ in range(REPS):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            planned = plan([pages])
            t1 = time.perf_counter()
            b = fill(planned, dev)
            t2 = time.perf_counter()
            torch.cuda.synchronize(dev)
            t3 = time.perf_counter()
            s = PendingSums(b[: planned.payload])
            t4 = time.perf_counter()
            s.wait()
            t5 = time.perf_counter()
            for key, v in zip(ph, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                ph[key].append(v)
        res.update(ph)
    dist.barrier()
    conn.close()
    dist.destroy_process_group()
    rq.put((rank, {k: 1e3 * statistics.median(v) for k, v in res.items()}))


def _instrument(rank: int) -> list[tuple[str, float]]:
    """Timestamps of the connector's steps (wrapped methods), for the phase split."""
    from pd_ssm.state_transfer import nccl_batch, nccl_inbound, nccl_message, nccl_receiver, nccl_sender

    marks: list[tuple[str, float]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            marks.append((label + ".start", time.perf_counter()))
            out = fn(*a, **k)
            marks.append((label + ".end", time.perf_counter()))
            return out

        setattr(owner, name, timed)

    if rank == 0:
        wrap(nccl_batch, "fill", "layout")  # block sums into the trailer included
        wrap(nccl_message, "write_sums", "sums")
        wrap(nccl_sender.NcclSender, "_dispatch", "dispatch")  # metadata out, p2p send posted
        wrap(nccl_sender.NcclSender, "_check_dropped", "probe")
    else:
        wrap(nccl_receiver.NcclReceiver, "_read", "read")
        wrap(nccl_receiver.NcclReceiver, "_sums_behind_recv", "sums_queued")
        wrap(nccl_receiver.NcclReceiver, "_wait", "wait")
        wrap(nccl_inbound, "parse_requests", "parse")
        wrap(nccl_inbound.Inbound, "block_sums", "block_sums")
        wrap(nccl_receiver, "unpack_runs", "unpack")  # the name nccl_receiver calls
    marks.append(("barrier", 0.0))
    return marks


def _phases(marks: list[tuple[str, float]]) -> dict[str, list[float]]:
    """Per run: each mark's time after the run's barrier (the first mark of the run)."""
    runs: list[dict[str, float]] = []
    for label, t in marks:
        if label == "barrier":
            continue
        if label.startswith(("layout.start", "read.start")) and (not runs or label in runs[-1]):
            runs.append({})
        if runs and label not in runs[-1]:
            runs[-1][label] = t
    out: dict[str, list[float]] = {}
    for r in runs[2:]:
        t0 = min(r.values())
        for label, t in r.items():
            out.setdefault("at:" + label, []).append(t - t0)
    return out


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q, rq = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, port, q, rq)) for r in (1, 0)]
    for p in procs:
        p.start()
    got = dict(rq.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    summary = {"sender_ms": got[0], "receiver_ms": got[1], "raw_GBps": N / got[1]["raw_default"] / 1e6}
    print(json.dumps(summary, indent=1))
    (out / "nccl_overhead.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
