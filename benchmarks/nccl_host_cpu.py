"""Per-request HOST time of the NCCL connector, on the CPU (gloo), with pages too small for their
bytes to matter: what is left is the Python and the launches per request, the part that keeps the
connector below the link on the H200 (RESULTS.md). Two spawned processes; the sender posts `n`
requests back to back and flushes, the receiver takes them; each side timed on its own clock,
medians of `reps` rounds after a warm-up: the sender's `send` calls alone (wall), end to end from
the sender's first `send` to the receiver holding the last request (perf_counter is
CLOCK_MONOTONIC: one clock for both processes), and the CPU time each process spent (all its
threads, gloo's included: the host work, robust to a busy machine, which wall times are not).

    python benchmarks/nccl_host_cpu.py [--n 8] [--reps 30] [--pages mamba2|hybrid] [--layers 64] [--coalesce-bytes 1]
                                       [--layers-per-part 12]

env PROFILE_DIR=<dir>: each side's timed rounds run under cProfile, stats in <dir>/{sender,receiver}.prof.

`--layers`: layers per request (tiny tensors each); 64 is Mamba2-2.7B's count, what a run
header's layer list and the per-layer work scale with.
`--layers-per-part K`: layer-wise streaming (`send_layers` once per layer, then the final `send`),
stream_bytes set so a part holds K layers (12: 32 MiB parts of 2.7B fp32 pages).

Prints microseconds per request (JSON).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKEN = "host-cpu"


def _profiler() -> cProfile.Profile | None:
    return cProfile.Profile() if os.environ.get("PROFILE_DIR") else None


def _dump(prof: cProfile.Profile | None, role: str) -> None:
    if prof is not None:
        prof.dump_stats(str(Path(os.environ["PROFILE_DIR"]) / f"{role}.prof"))


def _sender(rendezvous: str, kind: str, layers: int, n: int, reps: int, coalesce: int, per_part: int, go: Any,
            out: Any) -> None:
    from pd_ssm.bench.transfer import PageShape, make_pages, renamed
    from pd_ssm.cache.pages import StatePages
    from pd_ssm.state_transfer.base import Ticket
    from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector

    pages = make_pages("h", kind, torch.float32, dataclasses.replace(PageShape.tiny(), layers=layers))
    per_layer = list(pages.layers.values())  # views, as the engine's LayerExporter hands them
    stream = per_part > 0
    config = NcclConfig(TOKEN, rendezvous, timeout=30, send_timeout=30, coalesce_bytes=coalesce, stream_layers=stream)
    if stream:
        config.stream_bytes = per_part * max(p.nbytes() for p in per_layer)
    tx = NcclConnector(config)
    assert tx.address is not None
    starts, sends, cpu = [], [], []
    prof = _profiler()
    for r in range(reps + 1):
        go.get()  # the receiver reserved this round's requests
        if prof is not None and r == 1:
            prof.enable()
        c0 = time.process_time()
        t0 = time.perf_counter()
        for j in range(n):
            rid = f"h{r}-{j}"
            ticket = Ticket(rid, tx.address, 0, [], time.monotonic() + 600, TOKEN)
            if stream:
                for layer in per_layer:
                    tx.send_layers(ticket, [layer])
                tx.send(StatePages(dataclasses.replace(pages.request, req_id=rid)), ticket)
            else:
                tx.send(renamed(pages, rid), ticket)
        sends.append(time.perf_counter() - t0)
        starts.append(t0)
        assert tx.flush(30), tx.get_failed()
        tx.get_finished()
        cpu.append(time.process_time() - c0)
    if prof is not None:
        prof.disable()
    _dump(prof, "sender")
    out.put(("sender", (starts[1:], sends[1:], cpu[1:])))
    go.get()
    tx.close()


def _receiver(kind: str, n: int, reps: int, go: Any, out: Any, rq: Any) -> None:
    from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector
    from pd_ssm.state_transfer.reservations import ReservationTable

    table = ReservationTable(ttl=600, token=TOKEN)
    rx = NcclConnector(NcclConfig(TOKEN, "tcp://127.0.0.1:0", timeout=30), bind="tcp://127.0.0.1:0",
                       reservations=table)
    rq.put(rx.rendezvous)
    while not rx.paired:
        rx.recv(timeout=0.05)
    ends, cpu = [], []
    prof = _profiler()
    for r in range(reps + 1):
        for j in range(n):
            table.reserve(f"h{r}-{j}", rx.address or "", slot=0)
        go.put(r)
        if prof is not None and r == 1:
            prof.enable()
        c0 = time.process_time()
        got = [rx.recv(timeout=30) for _ in range(n)]
        ends.append(time.perf_counter())  # CLOCK_MONOTONIC: comparable with the sender's
        cpu.append(time.process_time() - c0)
        assert all(g is not None for g in got), rx.get_failed()
        rx.get_finished()
    if prof is not None:
        prof.disable()
    _dump(prof, "receiver")
    out.put(("receiver", (ends[1:], cpu[1:])))
    go.put(None)
    rx.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--pages", default="mamba2", choices=["mamba2", "hybrid"])
    ap.add_argument("--layers", type=int, default=4, help="layers per request (64: Mamba2-2.7B's)")
    ap.add_argument("--coalesce-bytes", type=int, default=256 << 20, help="NcclConfig.coalesce_bytes (1: one request a message)")
    ap.add_argument("--layers-per-part", type=int, default=0, help="stream layer by layer, K layers a part (0: whole requests)")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    go, out, rq = ctx.Queue(), ctx.Queue(), ctx.Queue()
    rx = ctx.Process(target=_receiver, args=(a.pages, a.n, a.reps, go, out, rq))
    rx.start()
    tx = ctx.Process(target=_sender, args=(rq.get(timeout=60), a.pages, a.layers, a.n, a.reps, a.coalesce_bytes,
                                             a.layers_per_part, go, out))
    tx.start()
    got = dict(out.get(timeout=300) for _ in range(2))
    for p in (tx, rx):
        p.join(30)
    starts, sends, tx_cpu = got["sender"]
    ends, rx_cpu = got["receiver"]
    e2e = [end - start for start, end in zip(starts, ends, strict=True)]
    print(json.dumps({
        "pages": a.pages, "layers": a.layers, "n": a.n, "coalesce_bytes": a.coalesce_bytes,
        "layers_per_part": a.layers_per_part,
        "send_calls_us_per_request": round(1e6 * statistics.median(sends) / a.n, 1),
        "end_to_end_us_per_request": round(1e6 * statistics.median(e2e) / a.n, 1),
        "sender_cpu_us_per_request": round(1e6 * statistics.median(tx_cpu) / a.n, 1),
        "receiver_cpu_us_per_request": round(1e6 * statistics.median(rx_cpu) / a.n, 1),
    }))


if __name__ == "__main__":
    main()
