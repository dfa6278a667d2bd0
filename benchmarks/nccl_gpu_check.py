"""Two-process check of the NCCL connector on Mamba2-2.7B-sized pages.

    python benchmarks/nccl_gpu_check.py                  # 2 GPUs: cuda:0 sends, cuda:1 receives (NCCL)
    python benchmarks/nccl_gpu_check.py --device cpu --layers 4 --ssm-shape 8,16,32   # gloo, small

Per request: 64 SSM layers, each a conv state [5376, 3] bf16 and an SSM state [80, 64, 128] fp32
(168 MB). Phase "exact": one request, bit-exact. Phase "in_flight": 64 requests sent back to back
without waiting (the receiver holds them all, then checks), all bit-exact, nothing failed, the
reservation table empty and no send left holding a buffer. Pages are random (seeded, regenerated
on the receiver's own device for the comparison), never zero.

Writes $OUT/nccl_gpu_check.json (OUT defaults to /tmp/out) and exits 1 on any mismatch, failure
or missing report; 2 if the machine lacks the devices asked for.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages  # noqa: E402
from pd_ssm.state_transfer.base import Ticket  # noqa: E402
from pd_ssm.state_transfer.nccl_config import NcclConfig  # noqa: E402
from pd_ssm.state_transfer.nccl_connector import NcclConnector  # noqa: E402
from pd_ssm.state_transfer.reservations import ReservationTable  # noqa: E402

TOKEN = "nccl-gpu-check"


@dataclass(frozen=True, slots=True)
class Setup:
    layers: int
    conv_shape: tuple[int, ...]  # bf16
    ssm_shape: tuple[int, ...]  # fp32
    in_flight: int
    timeout: float  # seconds: pairing, each p2p, each phase
    sender_device: str
    receiver_device: str

    def request_ids(self) -> list[str]:
        return ["exact"] + [f"f{i}" for i in range(self.in_flight)]


def make_pages(req_id: str, seed: int, s: Setup, device: str) -> StatePages:
    g = torch.Generator(device=device).manual_seed(seed)
    pages = StatePages(RequestState(req_id, [11, 7, 5], [3], 3, {"temperature": 0.0}, seed, 16))
    for i in range(s.layers):
        conv = (torch.randn(s.conv_shape, generator=g, device=device) + 3.0).to(torch.bfloat16)
        ssm = torch.randn(s.ssm_shape, generator=g, device=device) + 3.0
        pages.layers[i] = LayerPages(i, "ssm", {"conv": conv, "ssm": ssm})
    return pages


def seed_of(req_id: str) -> int:
    return 0 if req_id == "exact" else 1 + int(req_id[1:])


def mismatches(a: StatePages, b: StatePages) -> list[str]:
    """Every tensor of `a` that `b` does not hold bit for bit (or at all)."""
    bad = []
    for idx, page in a.layers.items():
        for name, t in page.tensors.items():
            o = b.layers[idx].tensors.get(name) if idx in b.layers else None
            if o is None or o.dtype != t.dtype or o.shape != t.shape or not torch.equal(
                t.reshape(-1).view(torch.uint8), o.to(t.device).reshape(-1).view(torch.uint8)
            ):
                bad.append(f"layer {idx} {name}")
    return bad


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def receiver_main(s: Setup, to_sender: Any, report: Any) -> None:
    table = ReservationTable(ttl=10 * s.timeout, token=TOKEN)
    for slot, req_id in enumerate(s.request_ids()):
        table.reserve(req_id, "-", slot)
    config = NcclConfig(TOKEN, "tcp://127.0.0.1:0", device=s.receiver_device, timeout=s.timeout)
    with NcclConnector(config, bind="tcp://127.0.0.1:0", reservations=table) as rx:
        assert isinstance(rx, NcclConnector)
        to_sender.put(rx.rendezvous)
        got: dict[str, StatePages] = {}
        failed: dict[str, str] = {}
        end = time.monotonic() + 3 * s.timeout
        while len(got) + len(failed) < len(s.request_ids()) and time.monotonic() < end:
            pages = rx.recv(timeout=0.5)
            if pages is not None:
                got[pages.req_id] = pages  # held until all arrived: checking is not timed
            failed.update(rx.get_failed())
        stats = rx.get_stats()
        bad = {}
        for req_id, pages in got.items():
            wrong = mismatches(make_pages(req_id, seed_of(req_id), s, s.receiver_device), pages)
            if wrong:
                bad[req_id] = wrong[:8]
        report.put({
            "role": "receiver",
            "received": len(got),
            "missing": sorted(set(s.request_ids()) - set(got)),
            "mismatched": bad,
            "failed": failed,
            "reservations_left": len(table),
            "recv_gbps": {r: round(st.gbps, 2) for r, st in stats.items()},
            "pages_on": str(next(iter(got.values())).layers[0].tensors["ssm"].device) if got else None,
        })


def sender_main(s: Setup, rendezvous: str, report: Any) -> None:
    dev = s.sender_device
    tx = NcclConnector(NcclConfig(TOKEN, rendezvous, device=dev, timeout=s.timeout))
    assert tx.address is not None

    def ticket(req_id: str) -> Ticket:
        return Ticket(req_id, str(tx.address), slot=0, expiry=time.monotonic() + 10 * s.timeout, token=TOKEN)

    phases: dict[str, Any] = {}
    for phase, ids in (("exact", ["exact"]), ("in_flight", s.request_ids()[1:])):
        batch = [make_pages(r, seed_of(r), s, dev) for r in ids]  # made before the clock starts
        nbytes = sum(p.nbytes() for p in batch)
        _sync(dev)
        t0 = time.perf_counter()
        for pages in batch:
            tx.send(pages, ticket(pages.req_id))
        posted = tx.in_flight
        flushed = tx.flush(s.timeout)
        _sync(dev)
        seconds = time.perf_counter() - t0
        sent, _ = tx.get_finished()
        phases[phase] = {
            "requests": len(ids), "bytes": nbytes, "seconds": round(seconds, 4),
            "gbps": round(nbytes / seconds / 1e9, 2), "posted_at_once": posted, "flushed": flushed,
            "sent": len(sent), "failed": tx.get_failed(), "left_in_flight": tx.in_flight,
        }
        del batch
    report.put({"role": "sender", "phases": phases})
    tx.close()


def run(s: Setup, out_dir: Path) -> int:
    ctx = mp.get_context("spawn")
    rendezvous, report = ctx.Queue(), ctx.Queue()
    rx = ctx.Process(target=receiver_main, args=(s, rendezvous, report))
    rx.start()
    procs = [rx]
    reports: dict[str, Any] = {}
    try:
        tx = ctx.Process(target=sender_main, args=(s, rendezvous.get(timeout=s.timeout), report))
        tx.start()
        procs.append(tx)
        while len(reports) < 2:
            r = report.get(timeout=4 * s.timeout)
            reports[r.pop("role")] = r
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(s.timeout)
            if p.is_alive():
                p.kill()
                p.join()
    problems = check(s, reports, [p.exitcode for p in procs])
    summary = {"setup": {k: getattr(s, k) for k in Setup.__slots__}, **reports, "problems": problems, "ok": not problems}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "nccl_gpu_check.json"
    path.write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary.get("sender", {}).get("phases", {}), indent=2))
    print(f"{'OK' if not problems else 'FAILED: ' + '; '.join(problems)} -> {path}")
    return 0 if not problems else 1


def check(s: Setup, reports: dict[str, Any], exitcodes: list[int | None]) -> list[str]:
    problems = [f"a process exited with {c}" for c in exitcodes if c != 0]
    rx, tx = reports.get("receiver"), reports.get("sender")
    if rx is None or tx is None:
        return problems + [f"missing report(s): got {sorted(reports)}"]
    if rx["missing"]:
        problems.append(f"received {rx['received']} of {len(s.request_ids())} requests; missing {rx['missing'][:8]}")
    problems += [f"{r} differs: {w}" for r, w in rx["mismatched"].items()]
    problems += [f"receiver failed {r}: {why}" for r, why in rx["failed"].items()]
    if rx["reservations_left"]:
        problems.append(f"{rx['reservations_left']} reservations left on the receiver")
    for name, ph in tx["phases"].items():
        if ph["failed"] or ph["sent"] != ph["requests"] or ph["left_in_flight"] or not ph["flushed"]:
            problems.append(f"sender phase {name}: {ph}")
    if s.in_flight and tx["phases"]["in_flight"]["posted_at_once"] < s.in_flight:
        problems.append("the in-flight phase did not have every request on the wire at once")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--conv-shape", default="5376,3")
    ap.add_argument("--ssm-shape", default="80,64,128")
    ap.add_argument("--in-flight", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args(argv)
    if a.device == "cuda" and torch.cuda.device_count() < 2:
        print(f"needs 2 CUDA devices, found {torch.cuda.device_count()}; use --device cpu for gloo", file=sys.stderr)
        return 2
    devices = ("cuda:0", "cuda:1") if a.device == "cuda" else ("cpu", "cpu")
    shape = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    s = Setup(a.layers, shape(a.conv_shape), shape(a.ssm_shape), a.in_flight, a.timeout, *devices)
    return run(s, Path(os.environ.get("OUT", "/tmp/out")))


if __name__ == "__main__":
    sys.exit(main())
