"""`bench transfer`, stream part: how much of the transfer layer-wise streaming hides behind prefill.

A prefill engine (`Engine.stream_prefills_to`) ships a request of `tokens` random tokens through
a ConnectorSink into a ZmqConnector -- or, `connector="nccl"`, an NcclConnector streaming in parts
(NcclConfig.stream_layers; cuda:0 -> cuda:1 on CUDA, gloo on the CPU) -- whose receiver
runs in a spawned process of its own, as a decode worker does (a receiving thread here would take the GIL from the host-bound eager forward
it is meant to overlap: 180.8 ms streamed against 98.5 ms sequential on the H200, RESULTS.md
session 4). Per run:

  prefill    step() calls from add_request until the request has left the engine (its first
             token sampled, its last layers and state handed to the connector)
  transfer   first layer handed to the connector -> the receiver holds the whole checked request
  overlap    the part of the transfer that ran while the prefill was still computing
  exposed    what is left after the prefill: prefill end -> request received
  whole send without streaming: the exported request's one send -> received
  streamed total     prefill start -> request received, with streaming
  sequential total   the same on a second engine without streaming: prefill, export, one send
                     (NCCL on CUDA: both engines run their prefill in CUDA graphs, the streaming
                     one with its copies gated on the graph's layer events, layer_export.py;
                     `graph` says whether its forward did; ZMQ streams from the eager forward's
                     per-layer hooks)

Default model: Mamba2-2.7B shapes with dummy weights on CUDA (bench/engine.py's config), the
embedded tiny hybrid on the CPU. Medians over the runs after one warm-up.
"""

from __future__ import annotations

import hashlib
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from pd_ssm.bench.transfer_zmq import _Peer
from pd_ssm.cache.pages import LayerPages, RequestState, StatePages
from pd_ssm.engine.engine import Engine
from pd_ssm.sampling_params import SamplingParams
from pd_ssm.state_transfer.connector_sink import ConnectorSink
from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector
from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector

TOKEN = "bench-stream"


class _TimedSink:
    """A PageSink in front of the ConnectorSink that notes when the first layer was handed over."""

    def __init__(self, inner: ConnectorSink) -> None:
        self.inner = inner
        self.first: float | None = None

    @property
    def device_pages(self) -> bool:
        return self.inner.device_pages

    def send_layers(self, req_id: str, layers: list[LayerPages], ready: Any = None, last: bool = False) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.inner.send_layers(req_id, layers, ready, last)

    def finish(self, request: RequestState) -> None:
        self.inner.finish(request)

    def finish_pages(self, pages: StatePages) -> None:
        self.inner.finish_pages(pages)

    def cancel(self, req_id: str) -> None:
        self.inner.cancel(req_id)


def _engine(model: str, device: str, tokens: int, dummy: bool, eager: bool = True) -> Engine:
    from pd_ssm import LLM

    return LLM(model=model, device=device, load_format="dummy" if dummy else "auto", max_num_seqs=4,
               max_num_batched_tokens=tokens, max_model_len=tokens + 16, num_kv_blocks=4 * (tokens // 16 + 2),
               gpu_memory_utilization=0.4, enforce_eager=eager).engine


def stream_overlap(model: str | None, device: str, tokens: int, repeats: int, timeout: float,
                   connector: str = "zmq") -> dict[str, Any]:
    if connector not in ("zmq", "nccl"):
        raise ValueError(f"bench stream: connector must be zmq or nccl, got {connector!r}")
    if model is not None or device != "cuda":
        return _measure(model, device, tokens, repeats, timeout, connector, dummy=False)
    from pd_ssm.bench.shapes import write_shape

    with tempfile.TemporaryDirectory() as tmp:
        return _measure(write_shape("mamba2-2.7b", tmp), device, tokens, repeats, timeout, connector, dummy=True, name="mamba2-2.7b (dummy)")


def _sender(connector: str, device: str, peer: _Peer, timeout: float) -> ZmqConnector | NcclConnector:
    if connector == "zmq":
        return ZmqConnector(ZmqConfig(TOKEN, send_timeout=timeout))
    rendezvous = peer.recv()  # the receiving process hosts the pairing
    dev = "cuda:0" if device == "cuda" else "cpu"
    return NcclConnector(NcclConfig(TOKEN, rendezvous, device=dev, timeout=timeout, send_timeout=timeout,
                                    stream_layers=True))


def _measure(model: str | None, device: str, tokens: int, repeats: int, timeout: float, connector: str,
             dummy: bool, name: str | None = None) -> dict[str, Any]:
    if model is None:
        from pd_ssm.default_model import random_model_dir

        model = str(random_model_dir())  # the tiny hybrid: this measures transfer, not text
    nccl = connector == "nccl"
    eager = not (nccl and device == "cuda")
    streaming = _engine(model, device, tokens, dummy, eager=eager)
    plain = _engine(model, device, tokens, dummy, eager=eager)
    runs: list[dict[str, float]] = []
    mbytes = 0.0
    with _Peer(_stream_receiver, (timeout, connector, device), timeout) as peer, \
            _sender(connector, device, peer, timeout) as tx:
        sink = _TimedSink(ConnectorSink(tx))
        if not sink.inner.streams:
            raise RuntimeError(f"bench stream: the {connector} connector does not stream layer by layer")
        streaming.stream_prefills_to(sink)
        g = torch.Generator().manual_seed(0)
        for i in range(repeats + 1):
            prompt = torch.randint(3, streaming.model_config.vocab_size, (tokens,), generator=g).tolist()
            run, mbytes = _one_run(streaming, plain, sink, tx, peer, prompt, f"s{i}", timeout)
            runs.append(run)
    keys = runs[0].keys()
    med = {k: statistics.median(r[k] for r in runs[1:]) for k in keys}
    pg = streaming.runner.prefill_graphs
    return dict(model=name or Path(model).name, tokens=tokens, mbytes=mbytes, runs=repeats, connector=connector,
                graph=pg is not None and pg.replays > 0,
                hidden=med["overlap_ms"] / med["transfer_ms"] if med["transfer_ms"] > 0 else 0.0, **med)


def _one_run(streaming: Engine, plain: Engine, sink: _TimedSink, tx: ZmqConnector | NcclConnector, peer: _Peer,
             prompt: list[int], rid: str, timeout: float) -> tuple[dict[str, float], float]:
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    # streamed: layers leave while the forward runs
    sink.first = None
    peer.send((rid, 0))
    sink.inner.expect(peer.recv())  # reserved by the receiver, which now waits in recv
    t0 = time.perf_counter()
    streaming.add_request(prompt, params, request_id=rid)
    while streaming.has_unfinished():
        streaming.step()
    t_prefill = time.perf_counter()
    tx.flush(timeout)  # the last pieces may still be checksumming: push them out
    t_recv, streamed, mbytes = peer.recv()
    if sink.first is None:
        raise RuntimeError(f"bench stream: request {rid} handed no layer to the connector")
    # sequential: prefill, export the whole request, one send
    seq = rid + "-seq"
    peer.send((seq, 1))
    ticket = peer.recv()
    t1 = time.perf_counter()
    plain.add_request(prompt, params, request_id=seq)
    while not plain.requests[seq].output_token_ids:
        plain.step()
    whole_pages = plain.export_request(seq)
    t_sent = time.perf_counter()
    tx.send(whole_pages, ticket)
    tx.flush(timeout)
    t_seq, whole, _ = peer.recv()
    if whole != streamed:  # streamed and whole must be the same bytes (digests made untimed)
        raise RuntimeError(f"bench stream: request {rid} streamed differs from its whole export")
    run = dict(
        prefill_ms=1e3 * (t_prefill - t0),
        transfer_ms=1e3 * (t_recv - sink.first),
        overlap_ms=1e3 * max(0.0, min(t_prefill, t_recv) - sink.first),
        exposed_ms=1e3 * max(0.0, t_recv - t_prefill),
        whole_send_ms=1e3 * (t_seq - t_sent),
        streamed_total_ms=1e3 * (t_recv - t0),
        sequential_total_ms=1e3 * (t_seq - t1),
    )
    return run, mbytes


def _stream_receiver(conn: Connection, timeout: float, connector: str = "zmq", device: str = "cpu") -> None:
    """The stream bench's receiving process: per (request id, slot) it reserves the slot, answers
    the ticket, receives the request and answers (perf_counter when it was whole and checked, a
    digest of its bytes in layer order, MB); perf_counter is one clock for every process. NCCL:
    it first answers its rendezvous and pairs with the sender (on cuda:1 on CUDA)."""
    from pd_ssm.state_transfer.reservations import ReservationTable

    table = ReservationTable(ttl=timeout, token=TOKEN)
    rx: ZmqConnector | NcclConnector
    if connector == "zmq":
        rx = ZmqConnector(ZmqConfig(TOKEN, send_timeout=timeout), bind="tcp://127.0.0.1:0", reservations=table)
    else:
        dev = "cuda:1" if device == "cuda" else "cpu"
        rx = NcclConnector(NcclConfig(TOKEN, "tcp://127.0.0.1:0", device=dev, timeout=timeout),
                           bind="tcp://127.0.0.1:0", reservations=table)
        conn.send(rx.rendezvous)
        end = time.monotonic() + timeout
        while not rx.paired and time.monotonic() < end:
            rx.recv(timeout=0.05)
    with rx:
        assert rx.address is not None
        while (msg := conn.recv()) is not None:
            req_id, slot = msg
            conn.send(table.reserve(req_id, rx.address, slot=slot))
            pages = rx.recv(timeout=timeout)
            done = time.perf_counter()
            if pages is None:
                raise RuntimeError(f"bench stream: {req_id} not received in {timeout} s: {rx.get_failed()}")
            digest = hashlib.sha256()
            for idx in sorted(pages.layers):
                for tname, t in sorted(pages.layers[idx].tensors.items()):
                    digest.update(tname.encode())
                    digest.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
            conn.send((done, digest.hexdigest(), pages.nbytes() / 1e6))
