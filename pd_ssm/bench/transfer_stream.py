"""`bench transfer`, stream part: how much of the transfer layer-wise streaming hides behind prefill.

A prefill engine (`Engine.stream_prefills_to`) ships a request of `tokens` random tokens through
a ConnectorSink into a ZmqConnector whose receiver runs in a thread of this process. Per run:

  prefill    step() calls from add_request until the request has left the engine (its first
             token sampled, its last layers and state handed to the connector)
  transfer   first layer handed to the connector -> the receiver holds the whole checked request
  overlap    the part of the transfer that ran while the prefill was still computing
  exposed    what is left after the prefill: prefill end -> request received
  whole send without streaming: the exported request's one send -> received
  streamed total     prefill start -> request received, with streaming
  sequential total   the same on a second engine without streaming: prefill, export, one send

Default model: Mamba2-2.7B shapes with dummy weights on CUDA (bench/engine.py's config), the
embedded tiny hybrid on the CPU. Medians over the runs after one warm-up.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from pd_ssm.cache.pages import LayerPages, RequestState, StatePages
from pd_ssm.engine.engine import Engine
from pd_ssm.sampling_params import SamplingParams
from pd_ssm.state_transfer.connector_sink import ConnectorSink
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector

TOKEN = "bench-stream"


class _TimedSink:
    """A PageSink in front of the ConnectorSink that notes when the first layer was handed over."""

    def __init__(self, inner: ConnectorSink) -> None:
        self.inner = inner
        self.first: float | None = None

    def send_layers(self, req_id: str, layers: list[LayerPages]) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.inner.send_layers(req_id, layers)

    def finish(self, request: RequestState) -> None:
        self.inner.finish(request)

    def finish_pages(self, pages: StatePages) -> None:
        self.inner.finish_pages(pages)

    def cancel(self, req_id: str) -> None:
        self.inner.cancel(req_id)


def _engine(model: str, device: str, tokens: int, dummy: bool) -> Engine:
    from pd_ssm import LLM

    return LLM(model=model, device=device, load_format="dummy" if dummy else "auto", max_num_seqs=4,
               max_num_batched_tokens=tokens, max_model_len=tokens + 16, num_kv_blocks=4 * (tokens // 16 + 2),
               gpu_memory_utilization=0.4, enforce_eager=True).engine


def stream_overlap(model: str | None, device: str, tokens: int, repeats: int, timeout: float) -> dict[str, Any]:
    if model is not None or device != "cuda":
        return _measure(model, device, tokens, repeats, timeout, dummy=False)
    from pd_ssm.bench.engine import MAMBA2_2_7B

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(MAMBA2_2_7B))
        return _measure(tmp, device, tokens, repeats, timeout, dummy=True, name="mamba2-2.7b (dummy)")


def _measure(model: str | None, device: str, tokens: int, repeats: int, timeout: float, dummy: bool,
             name: str | None = None) -> dict[str, Any]:
    if model is None:
        from pd_ssm.default_model import random_model_dir

        model = str(random_model_dir())  # the tiny hybrid: this measures transfer, not text
    streaming, plain = _engine(model, device, tokens, dummy), _engine(model, device, tokens, dummy)
    table = ReservationTable(ttl=timeout, token=TOKEN)
    runs: list[dict[str, float]] = []
    mbytes = 0.0
    with ZmqConnector(ZmqConfig(TOKEN, send_timeout=timeout), bind="tcp://127.0.0.1:0", reservations=table) as rx, \
            ZmqConnector(ZmqConfig(TOKEN, send_timeout=timeout)) as tx:
        sink = _TimedSink(ConnectorSink(tx))
        streaming.stream_prefills_to(sink)
        g = torch.Generator().manual_seed(0)
        for i in range(repeats + 1):
            prompt = torch.randint(3, streaming.model_config.vocab_size, (tokens,), generator=g).tolist()
            run, pages = _one_run(streaming, plain, sink, tx, rx, table, prompt, f"s{i}", timeout)
            mbytes = pages.nbytes() / 1e6
            runs.append(run)
    keys = runs[0].keys()
    med = {k: statistics.median(r[k] for r in runs[1:]) for k in keys}
    return dict(model=name or Path(model).name, tokens=tokens, mbytes=mbytes, runs=repeats,
                hidden=med["overlap_ms"] / med["transfer_ms"] if med["transfer_ms"] > 0 else 0.0, **med)


def _one_run(streaming: Engine, plain: Engine, sink: _TimedSink, tx: ZmqConnector, rx: ZmqConnector,
             table: ReservationTable, prompt: list[int], rid: str, timeout: float) -> tuple[dict[str, float], StatePages]:
    assert rx.address is not None
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    got: list[tuple[float, StatePages | None]] = []

    def receive() -> None:
        pages = rx.recv(timeout=timeout)
        got.append((time.perf_counter(), pages))

    # streamed: layers leave while the forward runs
    sink.first = None
    sink.inner.expect(table.reserve(rid, rx.address, slot=0))
    th = threading.Thread(target=receive)
    th.start()
    t0 = time.perf_counter()
    streaming.add_request(prompt, params, request_id=rid)
    while streaming.has_unfinished():
        streaming.step()
    t_prefill = time.perf_counter()
    tx.flush(timeout)  # the last pieces may still be checksumming: push them out
    th.join()
    t_recv, pages = got.pop()
    if pages is None or sink.first is None:
        raise RuntimeError(f"bench stream: request {rid} not received in {timeout} s: {rx.get_failed()}")
    # sequential: prefill, export the whole request, one send
    seq = rid + "-seq"
    ticket = table.reserve(seq, rx.address, slot=1)
    th = threading.Thread(target=receive)
    th.start()
    t1 = time.perf_counter()
    plain.add_request(prompt, params, request_id=seq)
    while not plain.requests[seq].output_token_ids:
        plain.step()
    whole_pages = plain.export_request(seq)
    t_sent = time.perf_counter()
    tx.send(whole_pages, ticket)
    tx.flush(timeout)
    th.join()
    t_seq, whole = got.pop()
    if whole is None:
        raise RuntimeError(f"bench stream: request {seq} not received in {timeout} s: {rx.get_failed()}")
    for idx, page in whole.layers.items():  # streamed and whole must be the same bytes (untimed)
        for tname, t in page.tensors.items():
            if not torch.equal(t.view(torch.uint8), pages.layers[idx].tensors[tname].view(torch.uint8)):
                raise RuntimeError(f"bench stream: layer {idx} {tname!r} streamed differs from the whole export")
    run = dict(
        prefill_ms=1e3 * (t_prefill - t0),
        transfer_ms=1e3 * (t_recv - sink.first),
        overlap_ms=1e3 * max(0.0, min(t_prefill, t_recv) - sink.first),
        exposed_ms=1e3 * max(0.0, t_recv - t_prefill),
        whole_send_ms=1e3 * (t_seq - t_sent),
        streamed_total_ms=1e3 * (t_recv - t0),
        sequential_total_ms=1e3 * (t_seq - t1),
    )
    return run, pages
