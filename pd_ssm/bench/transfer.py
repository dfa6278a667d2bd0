"""`pd-ssm bench transfer`: each connector against a raw baseline measured in the same run.

  zmq     ZmqConnector (frames, checksums, assembly, reservation) sender -> receiver on loopback,
          against a plain TCP socket on loopback (Python, `chunk` = 4 MB sends, recv_into one
          buffer) moving the same number of bytes. Target: >= 70% of the socket. Each receiver
          is a process of its own, as in a deployment (no GIL shared with the sender).
  nccl    NcclConnector between two processes (gloo on CPU; NCCL between cuda:0 and cuda:1),
          against raw torch.distributed send/recv of one request's bytes as one message
          (transfer_p2p.py): the connector with `in_flight` requests posted back to back (the
          row's GB/s and ratio; target >= 80%), and one request alone (its latency, in the JSON
          and after the table); row "nccl-stream": the same requests streamed layer by layer
          (parts of `NcclConfig.stream_bytes`), against the same raw figure (target >= 80%).
  stream  layer-wise streaming of a real engine prefill into a ZmqConnector: prefill time,
          transfer time and how much of the transfer hid behind the prefill (transfer_stream.py);
          `stream-nccl` the same into an NcclConnector streaming in parts.

Pages: `mamba2` = Mamba2-2.7B (64 SSM layers, conv [5376, 3] in bf16, SSM [80, 64, 128] in the
state dtype); `hybrid` = the same with every 8th layer attention instead (56 SSM + 8 attention
layers, K and V of `kv_tokens` tokens x 8 heads x 128 in bf16). State dtypes fp32 and bf16.
GB/s are 1e9 bytes of tensor payload per second (headers not counted), median of `repeats`
timed runs after one warm-up. `--tiny` shrinks every shape (for tests on the CPU).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages, runs_of

ZMQ_TARGET = 0.70  # x the raw socket
NCCL_TARGET = 0.80  # x raw send/recv
TOKEN = "bench-transfer"


@dataclass(slots=True)
class PageShape:
    layers: int = 64
    conv: tuple[int, int] = (5376, 3)
    ssm: tuple[int, int, int] = (80, 64, 128)
    attn_every: int = 8  # hybrid: layers 7, 15, ... are attention
    kv: tuple[int, int, int] = (2048, 8, 128)  # tokens, kv heads, head dim

    @staticmethod
    def tiny() -> PageShape:
        return PageShape(layers=4, conv=(48, 3), ssm=(4, 8, 16), attn_every=2, kv=(16, 2, 8))


@dataclass(slots=True)
class TransferBenchOptions:
    connectors: list[str] = field(default_factory=lambda: ["zmq", "nccl", "stream"])
    kinds: list[str] = field(default_factory=lambda: ["mamba2", "hybrid"])
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    shape: PageShape = field(default_factory=PageShape)
    repeats: int = 5
    in_flight: int = 8  # nccl: requests posted back to back in the timed run
    chunk: int = 4 << 20  # bytes per socket send of the baseline
    device: str = "cpu"  # cpu: gloo for nccl, a tiny engine for stream; cuda: NCCL, the 2.7B shape
    stream_model: str | None = None  # None: Mamba2-2.7B shape (dummy weights) on CUDA, tiny on CPU
    stream_tokens: int = 2048
    stream_bytes: int | None = None  # nccl: part size when streaming (None: NcclConfig's)
    timeout: float = 120.0

    def __post_init__(self) -> None:
        unknown = set(self.connectors) - {"zmq", "nccl", "stream", "stream-nccl"} | set(self.kinds) - {"mamba2", "hybrid"}
        if unknown or not set(self.dtypes) <= {"float32", "bfloat16"}:
            raise ValueError(f"bench transfer: unknown connector / page kind / dtype in {self}")
        if self.repeats < 1 or self.chunk < 1 or self.in_flight < 1:
            raise ValueError("bench transfer: repeats, chunk and in_flight must be >= 1")


def make_pages(req_id: str, kind: str, dtype: torch.dtype, shape: PageShape, seed: int = 0) -> StatePages:
    """Random (never zero) pages of one request, on the CPU, as runs (the form export_pages gives
    a prefill worker: one stacked tensor per name over the layers)."""
    g = torch.Generator().manual_seed(seed)

    def rand(dims: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        return (torch.randn(dims, generator=g) + 3.0).to(dt)

    req = RequestState(req_id, list(range(3, 40)), [7], 37, {"temperature": 0.0}, 1234, 16)
    pages = StatePages(req)
    for i in range(shape.layers):
        if kind == "hybrid" and i % shape.attn_every == shape.attn_every - 1:
            pages.layers[i] = LayerPages(i, "attention", {"k": rand(shape.kv, torch.bfloat16),
                                                          "v": rand(shape.kv, torch.bfloat16)})
        else:
            pages.layers[i] = LayerPages(i, "ssm", {"conv": rand(shape.conv, torch.bfloat16), "ssm": rand(shape.ssm, dtype)})
    return StatePages(req, runs=runs_of(pages.layers))


def renamed(pages: StatePages, req_id: str) -> StatePages:
    """The same tensors under another request id (no copy), in the same form (runs or layers)."""
    request = dataclasses.replace(pages.request, req_id=req_id)
    if pages.runs is not None:
        return StatePages(request, runs=pages.runs)
    return StatePages(request, pages.layers)


def median_gbps(nbytes: int, run: Callable[[int], float], repeats: int) -> float:
    """`run(i)` moves `nbytes` once and returns its seconds; run 0 is the warm-up."""
    run(0)
    return nbytes / statistics.median(run(i + 1) for i in range(repeats)) / 1e9


def check_same(sent: StatePages, got: StatePages) -> None:
    """A benchmark of a lossy transfer would be worthless: every byte is compared (untimed)."""
    for idx, page in sent.layers.items():
        for name, t in page.tensors.items():
            if not torch.equal(t.view(torch.uint8), got.layers[idx].tensors[name].cpu().view(torch.uint8)):
                raise RuntimeError(f"bench transfer: layer {idx} {name!r} arrived different")


# ------------------------------------------------------------------------------------ the run


def run_transfer_bench(opts: TransferBenchOptions, on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    for kind in opts.kinds:
        for dtype_name in opts.dtypes:
            pages = make_pages("bench", kind, getattr(torch, dtype_name), opts.shape)
            nbytes = pages.nbytes()
            base = dict(pages=kind, state_dtype=dtype_name, nbytes=nbytes, mbytes=nbytes / 1e6)
            if "zmq" in opts.connectors:
                from pd_ssm.bench.transfer_zmq import socket_runs, zmq_runs

                with socket_runs(nbytes, opts.chunk, opts.timeout) as run:
                    raw = median_gbps(nbytes, run, opts.repeats)
                with zmq_runs(kind, dtype_name, opts.shape, opts.timeout) as run:
                    got = median_gbps(nbytes, run, opts.repeats)
                add(dict(base, connector="zmq", baseline="tcp socket", gbps=got, baseline_gbps=raw,
                         ratio=got / raw, target=ZMQ_TARGET))
            if "nccl" in opts.connectors:
                from pd_ssm.bench.transfer_p2p import p2p_gbps

                g = p2p_gbps(kind, dtype_name, opts.shape, opts.device, opts.repeats, opts.timeout, opts.in_flight,
                             opts.stream_bytes)
                # NOTE: the target row is the connector under load (requests back to back); one
                # request alone is its latency, fixed per-request costs included (transfer_p2p.py)
                add(dict(base, connector="nccl", baseline="dist send/recv", gbps=g["in_flight"],
                         baseline_gbps=g["raw"], ratio=g["in_flight"] / g["raw"], target=NCCL_TARGET,
                         in_flight=opts.in_flight, one_gbps=g["one"], one_ratio=g["one"] / g["raw"]))
                add(dict(base, connector="nccl-stream", baseline="dist send/recv", gbps=g["streamed"],
                         baseline_gbps=g["raw"], ratio=g["streamed"] / g["raw"], target=NCCL_TARGET,
                         in_flight=opts.in_flight))
    stream: dict[str, Any] | None = None
    stream_nccl: dict[str, Any] | None = None
    if "stream" in opts.connectors or "stream-nccl" in opts.connectors:
        from pd_ssm.bench.transfer_stream import stream_overlap

        if "stream" in opts.connectors:
            stream = stream_overlap(opts.stream_model, opts.device, opts.stream_tokens, opts.repeats, opts.timeout)
        if "stream-nccl" in opts.connectors:
            stream_nccl = stream_overlap(opts.stream_model, opts.device, opts.stream_tokens, opts.repeats,
                                         opts.timeout, connector="nccl")
    return {"device": opts.device, "repeats": opts.repeats, "rows": rows, "stream": stream, "stream_nccl": stream_nccl}


def format_table(result: dict[str, Any]) -> str:
    head = f"{'connector':<9} {'pages':<7} {'state':<9} {'MB':>8} {'GB/s':>7} {'baseline':<15} {'GB/s':>7} {'ratio':>6} target"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        ok = "ok" if r["ratio"] >= r["target"] else "BELOW"
        lines.append(
            f"{r['connector']:<9} {r['pages']:<7} {r['state_dtype']:<9} {r['mbytes']:>8.2f} {r['gbps']:>7.3f} "
            f"{r['baseline']:<15} {r['baseline_gbps']:>7.3f} {r['ratio']:>6.2f} >= {r['target']:.2f} {ok}"
        )
    for r in result["rows"]:
        if "one_gbps" in r:
            lines.append(
                f"  nccl {r['pages']} {r['state_dtype']}: {r['in_flight']} requests back to back {r['gbps']:.1f} GB/s; "
                f"one request alone {r['one_gbps']:.1f} GB/s ({r['one_ratio']:.2f}x raw: its latency)"
            )
    for key, via in (("stream", "zmq"), ("stream_nccl", "nccl")):
        s = result.get(key)
        if not s:
            continue
        lines.append("")
        lines.append(
            f"layer-wise streaming over {via} ({s['model']}, {s['tokens']} tokens, {s['mbytes']:.1f} MB, "
            f"{'graph' if s.get('graph') else 'eager'} prefill): prefill "
            f"{s['prefill_ms']:.1f} ms, transfer {s['transfer_ms']:.1f} ms, overlap {s['overlap_ms']:.1f} ms "
            f"({100 * s['hidden']:.0f}% hidden), {s['exposed_ms']:.1f} ms left after the prefill vs "
            f"{s['whole_send_ms']:.1f} ms for a whole send; prefill start -> pages in: streamed "
            f"{s['streamed_total_ms']:.1f} ms vs prefill then send {s['sequential_total_ms']:.1f} ms"
        )
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
