"""Where a graph-prefill streamed request's time goes on the prefill side (nvidia-h200-x2): the
2.7B shape, 2048 tokens, streamed over NCCL to a receiving process on cuda:1, as `bench transfer
--connectors stream-nccl` does, with host timers around each phase of the step and CUDA events
around the graph on the compute stream:

  step_ms         the whole `Engine.step()` that runs the prefill (host)
  before_launch   step start -> the graph launched (scheduling, host rows, buffers)
  graph_ran_ms    the exporter queueing every layer's copies and the connector posting parts (host)
  after_ms        graph_ran's end -> step end (logits, sampling, reading the token, finish, final send)
  gpu_graph_ms    the graph on the compute stream (CUDA events around the replay)
  plain_gpu_ms    the same graph replayed with no streaming (the same engine, no targets)

    python benchmarks/stream_split_gpu.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_ssm.bench.shapes import MAMBA2_2_7B  # noqa: E402
from pd_ssm.bench.transfer_stream import _engine, _Peer, _sender, _stream_receiver, _TimedSink  # noqa: E402
from pd_ssm.engine.layer_export import LayerExporter  # noqa: E402
from pd_ssm.engine.prefill_graphs import PrefillGraphs  # noqa: E402
from pd_ssm.sampling_params import SamplingParams  # noqa: E402
from pd_ssm.state_transfer.connector_sink import ConnectorSink  # noqa: E402

TOKENS = 2048


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    marks: dict[str, float] = {}
    gpu: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    run, ran = PrefillGraphs.run, LayerExporter.graph_ran

    def timed_run(self: PrefillGraphs, rows: Any) -> torch.Tensor:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = run(self, rows)
        b.record()
        gpu.append((a, b))
        marks["launched"] = time.perf_counter()
        return out

    def timed_ran(self: LayerExporter, events: Any) -> None:
        ran(self, events)
        marks["ran"] = time.perf_counter()

    PrefillGraphs.run = timed_run  # type: ignore[method-assign]
    LayerExporter.graph_ran = timed_ran  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(MAMBA2_2_7B))
        eng = _engine(tmp, "cuda", TOKENS, True, eager=False)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, float]] = []
    with _Peer(_stream_receiver, (args.timeout, "nccl", "cuda"), args.timeout) as peer, \
            _sender("nccl", "cuda", peer, args.timeout) as tx:
        sink = _TimedSink(ConnectorSink(tx))
        exporter = eng.stream_prefills_to(sink)
        assert exporter.gated
        for i in range(args.runs + 1):
            prompt = torch.randint(3, eng.model_config.vocab_size, (TOKENS,), generator=g).tolist()
            rid = f"r{i}"
            peer.send((rid, 0))
            sink.inner.expect(peer.recv())
            eng.add_request(prompt, params, request_id=rid)
            marks.clear()
            t0 = time.perf_counter()
            while eng.has_unfinished():
                eng.step()
            t1 = time.perf_counter()
            tx.flush(args.timeout)
            t_recv, _, _ = peer.recv()
            a, b = gpu[-1]
            b.synchronize()
            rows.append(dict(step_ms=1e3 * (t1 - t0), before_launch=1e3 * (marks["launched"] - t0),
                             graph_ran_ms=1e3 * (marks["ran"] - marks["launched"]),
                             after_ms=1e3 * (t1 - marks["ran"]), gpu_graph_ms=a.elapsed_time(b),
                             exposed_ms=1e3 * (t_recv - t1)))
        # the same graph without streaming: no exporter targets
        eng.exporter = None
        eng.runner.layer_export = None
        plain = []
        for i in range(args.runs):
            prompt = torch.randint(3, eng.model_config.vocab_size, (TOKENS,), generator=g).tolist()
            eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                            request_id=f"p{i}")
            t0 = time.perf_counter()
            while eng.has_unfinished():
                eng.step()
            t1 = time.perf_counter()
            a, b = gpu[-1]
            b.synchronize()
            plain.append(dict(step_ms=1e3 * (t1 - t0), gpu_graph_ms=a.elapsed_time(b)))
    med = {k: statistics.median(r[k] for r in rows[1:]) for k in rows[0]}
    print(json.dumps({"streamed": med, "plain": {k: statistics.median(r[k] for r in plain) for k in plain[0]},
                      "runs": rows[1:]}, indent=1))


if __name__ == "__main__":
    main()
