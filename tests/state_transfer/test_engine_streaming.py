"""Layer-wise streaming from a prefill engine: each layer's pages leave as the forward finishes it.

Engine A (prefill role: `stream_prefills_to`) ships through a ConnectorSink into a real
ZmqConnector; engine B reserves first, imports what arrives and decodes. Tokens must equal a
colocated engine's (greedy and seeded, pure Mamba2 and hybrids), the streamed pages must equal a
whole-request export bit for bit, and requests that end early give every page back on both sides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pd_ssm import LLM, SamplingParams
from pd_ssm.cache.pages import LayerPages, RequestState, StatePages
from pd_ssm.engine.engine import Engine
from pd_ssm.state_transfer.base import Ticket
from pd_ssm.state_transfer.connector_sink import ConnectorSink
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.zmq_connector import ZmqConnector
from tests.conftest import needs_cuda, random_prompts
from tests.state_transfer.test_engine_transfer import (
    TOKEN,
    VOCAB,
    assert_clean,
    colocated,
    engine,
    import_and_decode,
    params_for,
    prefill,
)

MODELS = ["mamba2-g1", "bamba-attn-middle", "nemotron-h"]


class RecordingSink:
    """A PageSink that keeps every call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    def send_layers(self, req_id: str, layers: list[LayerPages], ready: Any = None, last: bool = False) -> None:
        assert ready is None, "a host sink gets host pages, complete when handed over"
        self.calls.append(("layers", req_id, layers))

    def finish(self, request: RequestState) -> None:
        self.calls.append(("finish", request.req_id, request))

    def finish_pages(self, pages: StatePages) -> None:
        self.calls.append(("finish_pages", pages.req_id, pages))

    def cancel(self, req_id: str) -> None:
        self.calls.append(("cancel", req_id, None))

    def pages(self, req_id: str) -> StatePages:
        (state,) = [c[2] for c in self.calls if c[:2] == ("finish", req_id)]
        layers = {p.layer_idx: p for c in self.calls if c[:2] == ("layers", req_id) for p in c[2]}
        return StatePages(state, dict(sorted(layers.items())))


class DeviceRecordingSink(RecordingSink):
    """A sink that takes device pages with their ready event, as the NCCL connector does."""

    device_pages = True

    def __init__(self) -> None:
        super().__init__()
        self.readies: list[torch.cuda.Event] = []
        self.lasts: dict[str, list[bool]] = {}

    def send_layers(self, req_id: str, layers: list[LayerPages], ready: Any = None, last: bool = False) -> None:
        assert isinstance(ready, torch.cuda.Event), "device pages come with the event they are complete after"
        self.readies.append(ready)
        self.lasts.setdefault(req_id, []).append(last)
        self.calls.append(("layers", req_id, layers))


def prefill_streaming(src: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> None:
    """Step the prefill engine until every request has left it (shipped or finished)."""
    for rid, prompt in prompts.items():
        src.add_request(prompt, params, request_id=rid)
    while src.has_unfinished():
        src.step()


def engine_on(path: Path, device: str) -> Engine:
    if device == "cpu":
        return engine(path)
    # eager: the GPU path of the exporter (side stream, pinned staging) is what is under test
    return LLM(model=str(path), device=device, enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=24,
               block_size=4, num_kv_blocks=64, gpu_memory_utilization=0.3).engine


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("name", MODELS)
def test_streamed_pages_equal_a_whole_export(name: str, device: str, hf_checkpoint: Any) -> None:
    path, _ = hf_checkpoint(name)
    params = params_for("seeded")
    prompts = dict(zip(["a", "b", "c"], random_prompts(VOCAB, [37, 5, 22], seed=3), strict=True))
    whole = prefill(engine_on(path, device), prompts, params)
    src, sink = engine_on(path, device), RecordingSink()
    exporter = src.stream_prefills_to(sink)
    prefill_streaming(src, prompts, params)
    assert_clean(src)
    cache_layers = sorted(exporter.cache_layers)
    for rid in prompts:
        got = sink.pages(rid)
        assert got.request == whole[rid].request and sorted(got.layers) == sorted(whole[rid].layers) == cache_layers
        for idx, page in whole[rid].layers.items():
            assert got.layers[idx].kind == page.kind
            for tname, t in page.tensors.items():
                other = got.layers[idx].tensors[tname]
                assert other.device.type == "cpu" and other.dtype == t.dtype
                assert torch.equal(other.view(torch.uint8), t.cpu().view(torch.uint8))
        # every layer once, in model order (the GPU hands over what is ready together), all before
        # the request's final call
        mine = [(kind, payload) for kind, r, payload in sink.calls if r == rid]
        assert [q.layer_idx for k, p in mine if k == "layers" for q in p] == cache_layers
        assert [k for k, _ in mine][-1] == "finish" and [k for k, _ in mine].count("finish") == 1


@needs_cuda
@pytest.mark.parametrize("name", MODELS)
def test_graph_prefill_streams_device_pages_behind_its_layer_events(name: str, hf_checkpoint: Any) -> None:
    """A device sink lets a streaming step run in its prefill CUDA graph: each layer's copies wait
    on the event the graph records after it (no host wait), and the pages equal those the same
    graph steps give a whole-request export."""
    path, _ = hf_checkpoint(name)
    params = params_for("seeded")
    prompts = dict(zip(["a", "b", "c"], random_prompts(VOCAB, [37, 5, 22], seed=3), strict=True))

    def graph_engine() -> Engine:
        return LLM(model=str(path), device="cuda", max_num_seqs=8, max_num_batched_tokens=24, block_size=4,
                   num_kv_blocks=64, gpu_memory_utilization=0.2).engine

    ref, ref_sink = graph_engine(), RecordingSink()
    ref.stream_prefills_to(ref_sink, per_layer=False)
    prefill_streaming(ref, prompts, params)
    whole = {rid: pages for kind, rid, pages in ref_sink.calls if kind == "finish_pages"}
    src, sink = graph_engine(), DeviceRecordingSink()
    exporter = src.stream_prefills_to(sink)
    pg = src.runner.prefill_graphs
    assert exporter.gated and pg is not None and pg.layer_events
    replays = pg.replays
    prefill_streaming(src, prompts, params)
    assert pg.replays > replays  # the streaming steps ran in graphs
    torch.cuda.synchronize()  # every copy behind its event has run (finish waited for them too)
    assert_clean(src)
    assert len(sink.readies) == sum(1 for c in sink.calls if c[0] == "layers")
    for rid in prompts:
        assert sink.lasts[rid][-1] and not any(sink.lasts[rid][:-1])  # its last layers say so, once
        got = sink.pages(rid)
        assert got.request == whole[rid].request
        assert sorted(got.layers) == sorted(whole[rid].layers) == sorted(exporter.cache_layers)
        for idx, page in whole[rid].layers.items():
            for tname, t in page.tensors.items():
                other = got.layers[idx].tensors[tname]
                assert other.device.type == "cuda" and other.dtype == t.dtype
                assert torch.equal(other.view(torch.uint8), t.view(torch.uint8)), (rid, idx, tname)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_whole_request_sink_gets_one_export_after_the_forward(device: str, hf_checkpoint: Any) -> None:
    """per_layer=False (the NCCL connector): no hook in the forward, then the whole request in one
    call (device tensors, as runs: the connector sends from the GPU), equal to a plain export."""
    path, _ = hf_checkpoint("bamba-attn-first")
    params = params_for("greedy")
    prompts = dict(zip(["a", "b"], random_prompts(VOCAB, [29, 6], seed=4), strict=True))
    whole = prefill(engine_on(path, device), prompts, params)
    src, sink = engine_on(path, device), RecordingSink()
    exporter = src.stream_prefills_to(sink, per_layer=False)
    hooks: list[object] = []
    original = exporter.begin
    exporter.begin = lambda sched: hooks.append(original(sched)) or hooks[-1]  # type: ignore[method-assign]
    prefill_streaming(src, prompts, params)
    assert_clean(src)
    assert hooks and all(h is None for h in hooks)
    for rid in prompts:
        mine = [(kind, payload) for kind, r, payload in sink.calls if r == rid]
        assert [k for k, _ in mine] == ["finish_pages"]
        pages = mine[0][1]
        assert pages.runs is not None  # as exported: stacked runs, no per-layer tensors made
        assert pages.request.output_token_ids == whole[rid].request.output_token_ids  # (seeds differ: greedy)
        assert sorted(pages.layers) == sorted(exporter.cache_layers)
        for page in pages.layers.values():
            for tname, t in page.tensors.items():
                assert t.device.type == device
                assert torch.equal(t.view(torch.uint8), whole[rid].layers[page.layer_idx].tensors[tname].view(torch.uint8))


def test_layers_leave_during_the_forward(hf_checkpoint: Any) -> None:
    """Each layer reaches the sink before the next decoder layer runs, not after the step."""
    path, _ = hf_checkpoint("nemotron-h")
    src, sink = engine(path), RecordingSink()
    src.stream_prefills_to(sink)
    seen: list[int] = []
    for i, layer in enumerate(src.model.backbone.layers):  # type: ignore[union-attr]
        layer.register_forward_pre_hook(lambda *_, i=i: seen.append(len([c for c in sink.calls if c[0] == "layers"])))
    src.add_request(random_prompts(VOCAB, [9], seed=1)[0], params_for("greedy"), request_id="x")
    src.step()
    # nemotron-h: mamba, attention, mlp, mamba, mlp -> pages of 0 and 1 out before layer 2 starts
    assert seen == [0, 1, 2, 2, 3] and [c[0] for c in sink.calls][-1] == "finish"


def disaggregated(
    src: Engine, dst: Engine, rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable,
    prompts: dict[str, list[int]], params: SamplingParams, late: frozenset[str] = frozenset(),
) -> dict[str, list[int]]:
    """Reserve on dst, stream from src (tickets of `late` requests given only after their prefill)."""
    assert rx.address is not None
    sink = ConnectorSink(tx)
    src.stream_prefills_to(sink)
    tickets: dict[str, Ticket] = {}
    for rid, prompt in prompts.items():
        slot, blocks = dst.reserve(rid, len(prompt) + 1)
        tickets[rid] = table.reserve(rid, rx.address, slot, blocks)
        if rid not in late:
            sink.expect(tickets[rid])
    prefill_streaming(src, prompts, params)
    assert sink.num_waiting == len(late)
    for rid in late:
        sink.expect(tickets[rid])
    assert sink.num_waiting == 0
    done = import_and_decode(src, dst, rx, tx, table, tickets)
    assert sink.take_failed() == {}
    return done


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_streamed_disaggregation_matches_colocated(
    name: str, sampling: str, hf_checkpoint: Any, rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable
) -> None:
    path, _ = hf_checkpoint(name)
    params = params_for(sampling)
    prompts = random_prompts(VOCAB, [37, 3, 19, 26, 1], seed=12)
    reference = colocated(path, prompts, params)
    ids = {f"s{i}": p for i, p in enumerate(prompts)}
    done = disaggregated(engine(path), engine(path), rx, tx, table, ids, params, late=frozenset({"s2"}))
    assert [done[rid] for rid in ids] == reference


def test_request_done_at_its_first_token_releases_both_sides(
    hf_checkpoint: Any, rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable
) -> None:
    """max_tokens=1: the prefill side has streamed its layers, then cancels; the decode side gets
    the sender's abort and frees the reservation."""
    path, _ = hf_checkpoint("bamba-attn-middle")
    src, dst = engine(path), engine(path)
    assert rx.address is not None
    sink = ConnectorSink(tx)
    src.stream_prefills_to(sink)
    prompt = random_prompts(VOCAB, [30], seed=4)[0]
    slot, blocks = dst.reserve("one", len(prompt) + 1)
    sink.expect(table.reserve("one", rx.address, slot, blocks))
    src.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), request_id="one")
    outs = []
    while src.has_unfinished():  # two chunks: the first streams nothing
        outs += src.step()
    assert [o.finished for o in outs] == [True]
    failed: dict[str, str] = {}
    for _ in range(100):
        tx.flush(0)
        assert rx.recv(timeout=0.02) is None
        failed.update(rx.get_failed())
        if failed:
            break
    assert "aborted by the sender" in failed["one"] and len(table) == 0
    dst.cancel_reservation("one")
    assert_clean(src)
    assert_clean(dst)
    assert sink.num_waiting == 0


def test_expired_ticket_fails_in_the_sink_not_the_engine(hf_checkpoint: Any, tx: ZmqConnector) -> None:
    path, _ = hf_checkpoint("mamba2-g1")
    src = engine(path)
    sink = ConnectorSink(tx)
    src.stream_prefills_to(sink)
    sink.expect(Ticket("old", "tcp://127.0.0.1:9", 0, [], expiry=0.0, token=TOKEN))
    src.add_request(random_prompts(VOCAB, [20], seed=6)[0], params_for("greedy"), request_id="old")
    prefill_streaming(src, {}, params_for("greedy"))
    failed = sink.take_failed()
    assert list(failed) == ["old"] and "expired" in failed["old"]
    assert sink.num_waiting == 0 and tx.get_failed() == {}
    assert_clean(src)
