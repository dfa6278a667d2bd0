"""Where a state transfer's time goes on the GPU: cProfile of both NCCL connector processes moving
8 x 168 MB requests back to back (cuda:0 -> cuda:1), and of the prefill engine's main thread
while it streams a 2048-token Mamba2-2.7B-shaped prefill over ZMQ (variants: no hook, hook only,
hook + copies, full streaming).

    python benchmarks/profile_transfer_gpu.py      # writes $OUT/profile_*.txt

A measuring aid for benchmarks/RESULTS.md, not a benchmark of record (`pd-ssm bench transfer` is).
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_ssm.bench import transfer_p2p  # noqa: E402
from pd_ssm.bench.transfer import PageShape  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))


def _dump(prof: cProfile.Profile, name: str) -> None:
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(35)
    st.sort_stats("tottime").print_stats(25)
    (OUT / f"profile_{name}.txt").write_text(s.getvalue())


def _profiled(role: str, fn: Any, *args: Any) -> None:
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn(*args)
    finally:
        prof.disable()
        _dump(prof, f"nccl_{role}")


def _sender(*args: Any) -> None:
    _profiled("sender", transfer_p2p._sender, *args)


def _receiver(*args: Any) -> None:
    _profiled("receiver", transfer_p2p._receiver, *args)


def nccl() -> None:
    transfer_p2p._sender = _sender  # type: ignore[assignment]  # the spawned targets, profiled
    transfer_p2p._receiver = _receiver  # type: ignore[assignment]
    got = transfer_p2p.p2p_gbps("mamba2", "float32", PageShape(), "cuda", 5, 120.0, 8)
    print("nccl", json.dumps(got), flush=True)


def stream() -> None:
    from pd_ssm import LLM, SamplingParams
    from pd_ssm.bench.shapes import MAMBA2_2_7B
    from pd_ssm.bench.transfer_stream import _TimedSink
    from pd_ssm.engine.layer_export import LayerExporter
    from pd_ssm.state_transfer.connector_sink import ConnectorSink
    from pd_ssm.state_transfer.reservations import ReservationTable
    from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector

    class NullSink:
        def send_layers(self, req_id: str, layers: Any) -> None:
            pass

        def finish(self, request: Any) -> None:
            pass

        def cancel(self, req_id: str) -> None:
            pass

    tokens = 2048
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(MAMBA2_2_7B))
        eng = LLM(model=tmp, device="cuda", load_format="dummy", max_num_seqs=4, max_num_batched_tokens=tokens,
                  max_model_len=tokens + 16, gpu_memory_utilization=0.4, enforce_eager=True).engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    rows: dict[str, float] = {}

    def prefill(name: str, n: int = 4, profile: bool = False) -> None:
        times = []
        prof = cProfile.Profile()
        for i in range(n + 1):
            prompt = torch.randint(3, 50000, (tokens,), generator=g).tolist()
            rid = f"{name}-{i}"
            if isinstance(eng.exporter, LayerExporter) and isinstance(eng.exporter.sink, _TimedSink):
                eng.exporter.sink.inner.expect(table.reserve(rid, rx.address or "", slot=0))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if profile and i:
                prof.enable()
            eng.add_request(prompt, params, request_id=rid)
            while eng.has_unfinished():
                eng.step()
            torch.cuda.synchronize()
            prof.disable()
            times.append(time.perf_counter() - t0)
            if isinstance(eng.exporter, LayerExporter) and isinstance(eng.exporter.sink, _TimedSink):
                # received only now (a thread during the prefill would share the GIL with it)
                got: list[Any] = []
                th = threading.Thread(target=lambda got=got: got.append(rx.recv(timeout=60.0)))
                th.start()
                tx.flush(60.0)
                th.join()
                if not got or got[0] is None:
                    raise RuntimeError(f"{rid} not received: {rx.get_failed()}")
        rows[name] = 1e3 * sorted(times[1:])[len(times[1:]) // 2]
        print(f"stream {name}: {rows[name]:.1f} ms", flush=True)
        if profile:
            _dump(prof, f"stream_{name}")

    table = ReservationTable(ttl=120.0, token="p")
    with ZmqConnector(ZmqConfig("p", send_timeout=60.0), bind="tcp://127.0.0.1:0", reservations=table) as rx, \
            ZmqConnector(ZmqConfig("p", send_timeout=60.0)) as tx:
        prefill("eager_no_hook")
        exporter = eng.stream_prefills_to(NullSink())
        # hook only: record an event per layer, nothing else
        exporter.layer_done = lambda layer_idx: torch.cuda.current_stream().record_event()  # type: ignore[method-assign]
        prefill("hook_event_only")
        exp2 = eng.stream_prefills_to(NullSink())
        prefill("hook_copies_null_sink", profile=True)
        eng.stream_prefills_to(_TimedSink(ConnectorSink(tx)))
        prefill("zmq_stream_rx_same_process", profile=True)
        del exp2
    (OUT / "profile_stream.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    which = sys.argv[1:] or ["nccl", "stream"]
    if "nccl" in which:
        nccl()
    if "stream" in which:
        stream()
