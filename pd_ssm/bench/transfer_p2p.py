"""`bench transfer` for the NCCL connector: NcclConnector vs raw torch.distributed send/recv.

Two spawned processes, rank 0 sending (cuda:0 on GPU) and rank 1 receiving (cuda:1); on the CPU
both use gloo. Each run is timed on the receiver from a barrier to the last byte in place (device
synchronized):

  raw        the request's bytes as ONE uint8 message on the default group (the baseline)
  one        the connector moving one request (metadata over ZMQ, p2p on its private group,
             checksums): a latency figure, fixed per-request costs included
  in flight  the connector moving `in_flight` requests posted back to back, as a prefill worker
             does under load: the first leaves alone, the ones sent while it is on its way are
             coalesced into messages of up to `coalesce_bytes` (nccl_batch.py), and the receiver
             posts the next recv while it checks one, so fixed per-message costs are shared and
             overlap the link; GB/s counts all their bytes
  streamed   the same `in_flight` requests streamed layer by layer, as a streaming prefill worker
             hands them over: `send_layers` once per layer, then the final `send` with no layer
             left (the connector sends parts of `stream_bytes`, larger while the hosts are behind:
             `NcclConfig.part_hold`) -- the link's rate when requests are handed over layer by
             layer with no compute in between (what the per-layer hand-over costs)

The first connector run is checked byte for byte against the pages the sender made.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from pd_ssm.bench.transfer import TOKEN, PageShape, check_same, make_pages, renamed
from pd_ssm.cache.pages import PageRun, StatePages


def p2p_gbps(
    kind: str, dtype: str, shape: PageShape, device: str, repeats: int, timeout: float, in_flight: int = 8,
    stream_bytes: int | None = None,
) -> dict[str, float]:
    """GB/s of "raw", "one" and "in_flight" (module docstring), medians of `repeats` runs after a warm-up."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        raise ValueError("bench transfer --device cuda needs two GPUs for the NCCL part (cuda:0 -> cuda:1)")
    ctx = mp.get_context("spawn")
    to_sender: Any = ctx.Queue()
    results: Any = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = (kind, dtype, shape, device, repeats, timeout, in_flight, port)
    procs = [ctx.Process(target=_receiver, args=(*args, to_sender, results)),
             ctx.Process(target=_sender, args=(*args, to_sender, stream_bytes))]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=timeout + 60)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    if isinstance(out, str):
        raise RuntimeError(f"bench transfer (nccl): the receiver failed: {out}")
    nbytes, times = out
    return {
        "raw": nbytes / statistics.median(times["raw"]) / 1e9,
        "one": nbytes / statistics.median(times["one"]) / 1e9,
        "in_flight": in_flight * nbytes / statistics.median(times["in_flight"]) / 1e9,
        "streamed": in_flight * nbytes / statistics.median(times["streamed"]) / 1e9,
    }


def _dev(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")


def _join_default_group(device: str, rank: int, port: int, timeout: float) -> None:
    from datetime import timedelta

    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _sender(kind: str, dtype: str, shape: PageShape, device: str, repeats: int, timeout: float, in_flight: int,
            port: int, to_sender: Any, stream_bytes: int | None) -> None:
    from pd_ssm.state_transfer.base import Ticket
    from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector

    dev = _dev(device, 0)
    host = make_pages("p2p", kind, getattr(torch, dtype), shape)
    assert host.runs is not None
    runs = [PageRun(r.kind, r.name, r.layers, r.stacked.to(dev)) for r in host.runs]
    pages = StatePages(host.request, runs=runs)  # on the device, as export_pages leaves them
    flat = torch.cat([r.stacked.reshape(-1).view(torch.uint8) for r in runs])
    rendezvous = to_sender.get(timeout=timeout)
    config = NcclConfig(TOKEN, rendezvous, device=str(dev), timeout=timeout, send_timeout=timeout, stream_layers=True)
    if stream_bytes is not None:
        config.stream_bytes = stream_bytes
    tx = NcclConnector(config)
    _join_default_group(device, 0, port, timeout)
    for _ in range(repeats + 1):
        dist.barrier()
        dist.send(flat, dst=1)
        _sync(dev)
    assert tx.address is not None
    for n in (1, in_flight):
        for i in range(repeats + 1):
            dist.barrier()
            for j in range(n):
                req = renamed(pages, f"p2p-{n}-{i}-{j}")
                tx.send(req, Ticket(req.req_id, tx.address, 0, [], time.monotonic() + timeout, TOKEN))
            if not tx.flush(timeout):
                raise RuntimeError(f"nccl bench: sends of run {i} did not complete in {timeout} s: {tx.get_failed()}")
    layers = list(StatePages(host.request, runs=runs).layers.values())  # per-layer views, as the engine hands them
    for i in range(repeats + 1):
        dist.barrier()
        for j in range(in_flight):
            rid = f"p2p-s-{i}-{j}"
            ticket = Ticket(rid, tx.address, 0, [], time.monotonic() + timeout, TOKEN)
            for layer in layers:
                tx.send_layers(ticket, [layer])
            tx.send(StatePages(dataclasses.replace(host.request, req_id=rid)), ticket)
        if not tx.flush(timeout):
            raise RuntimeError(f"nccl bench: streamed run {i} did not complete in {timeout} s: {tx.get_failed()}")
    dist.barrier()
    tx.close()
    dist.destroy_process_group()


def _receiver(kind: str, dtype: str, shape: PageShape, device: str, repeats: int, timeout: float, in_flight: int,
              port: int, to_sender: Any, results: Any) -> None:
    try:
        results.put(_receive(kind, dtype, shape, device, repeats, timeout, in_flight, port, to_sender))
    except Exception as e:  # reported to the parent, which raises it with the message
        results.put(f"{type(e).__name__}: {e}")


def _receive(kind: str, dtype: str, shape: PageShape, device: str, repeats: int, timeout: float, in_flight: int,
             port: int, to_sender: Any) -> tuple[int, dict[str, list[float]]]:
    from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector
    from pd_ssm.state_transfer.reservations import ReservationTable

    dev = _dev(device, 1)
    expect = make_pages("p2p", kind, getattr(torch, dtype), shape)
    nbytes = expect.nbytes()
    table = ReservationTable(ttl=timeout, token=TOKEN)
    rx = NcclConnector(NcclConfig(TOKEN, "tcp://127.0.0.1:0", device=str(dev), timeout=timeout),
                       bind="tcp://127.0.0.1:0", reservations=table)
    to_sender.put(rx.rendezvous)
    end = time.monotonic() + timeout
    while not rx.paired:  # the sender's hello is read inside recv
        if time.monotonic() > end:
            raise RuntimeError(f"nccl bench: no sender paired within {timeout} s")
        rx.recv(timeout=0.05)
    _join_default_group(device, 1, port, timeout)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    raw: list[float] = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.recv(buf, src=0)
        _sync(dev)
        raw.append(time.perf_counter() - t0)
    times: dict[str, list[float]] = {"raw": raw[1:]}
    for n, key in ((1, "one"), (in_flight, "in_flight"), (in_flight, "streamed")):
        runs: list[float] = []
        for i in range(repeats + 1):
            ids = [f"p2p-s-{i}-{j}" if key == "streamed" else f"p2p-{n}-{i}-{j}" for j in range(n)]
            for req_id in ids:
                table.reserve(req_id, rx.address or "", slot=0)
            dist.barrier()
            t0 = time.perf_counter()
            got = [rx.recv(timeout=timeout) for _ in ids]
            _sync(dev)
            runs.append(time.perf_counter() - t0)
            first = got[0]
            if first is None or any(g is None for g in got):
                raise RuntimeError(f"nccl bench: run {i} of {n}: a request did not arrive: {rx.get_failed()}")
            if i == 0:
                check_same(expect, first)
                last = got[-1]
                assert last is not None
                check_same(expect, last)
        times[key] = runs[1:]
    dist.barrier()
    rx.close()
    dist.destroy_process_group()
    return nbytes, times
