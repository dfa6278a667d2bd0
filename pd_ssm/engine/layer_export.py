"""LayerExporter: the prefill role streams each finished prefill out of the pool layer by layer.

When a step runs a request's last prefill chunk, every cache layer's pages of that request (SSM:
the conv and SSM state of its slot; attention: its KV) are final as soon as that layer's forward
is done. The runner gives the model a per-layer hook (`ForwardMeta.on_layer`) for such steps; the
hook snapshots the layer's pages and hands them to a `PageSink` (a connector), so the transfer
overlaps the remaining layers' compute. After sampling, the engine calls `finish` with the
request's state (first token, sampler state): the sink's last call for the request.

GPU ordering: the kernels are queued ahead of the device, so at hook time layer l has been
*launched*, not run. The hook records an event on the compute stream; a side stream waits for it
and copies the pages into pinned host staging (so the copy runs on a copy engine beside the next
layers' compute). A snapshot goes to the sink only once its copy has completed (event query, at
later hooks). The hook never waits for the device: an eager prefill is host-bound, so a host held
within 2 layers of the device left the GPU idle between layers (the streamed forward measured
~2-3x slower, RESULTS.md); the device keeps up with the host anyway, so earlier layers' copies
complete while later layers are being launched. `finish` and `cancel`
wait for every copy of the step, so by the time the engine frees the slot no copy still reads it
and no later step can overwrite it under one.

Device sinks (`device_pages`: a connector that sends from GPU memory, NCCL) get device staging
instead, handed over at once with the event that says it is complete (`ready`): the connector's
own stream waits for it, so neither the hook nor the connector ever waits on the host, and the
pages never go through host memory. Such a step may run in a prefill CUDA graph: the graph records
an event after each layer (prefill_graphs.py), and `graph_ran` queues the layers' copies behind
those events (GRAPH_STAGE_LAYERS at a time, fewer stages for a short step) right after the replay
is launched, so a graph prefill streams as an eager one does. The request's last layers go with
`last`, so the connector sends them at once rather than with the request's state after sampling.

Whole-request sinks (`per_layer=False`: a connector that sends a request in one piece, e.g. the
NCCL connector) get no hook at all -- the step may then run in a prefill CUDA graph -- and
`finish` exports the request in one gather per pool tensor, on the device (export_pages).

Decode steps never stream: their CUDA graphs are left alone (their captured ForwardMeta has no
hook).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from pd_ssm.cache.manager import CacheManager
from pd_ssm.cache.pages import LayerPages, RequestState, StatePages, export_layer, export_pages
from pd_ssm.cache.pool import CachePool
from pd_ssm.engine.schedule_types import SchedulerOutput

# graph_ran: cache layers staged behind one of the graph's layer events, by one batched copy. The
# connector makes parts of ~32 MiB (12 layers of 2.7B fp32 pages) anyway: finer gating would only
# add kernels beside the graph's (each small copy delays the prefill a little)
GRAPH_STAGE_LAYERS = 8
# graph_ran: at most one such stage per this many prefill tokens of the step. Each stage costs the
# host ~0.3-0.5 ms on the H200 machines (snapshots, then a part laid out and posted: RESULTS.md
# session 10) and a 2.7B prefill ~13 us a token, so a short prompt's graph ends before the host
# has handed over 8 stages: its layers go as fewer, larger stages (256 tokens: one, behind the
# last layer's event, with its layout and send queued while the graph runs)
GRAPH_TOKENS_PER_STAGE = 256


def graph_stage_layers(num_layers: int, step_tokens: int) -> int:
    """Cache layers per graph_ran stage for a step of `step_tokens` prefill tokens."""
    stages = max(1, min(-(-num_layers // GRAPH_STAGE_LAYERS), step_tokens // GRAPH_TOKENS_PER_STAGE))
    return -(-num_layers // stages)


class PageSink(Protocol):
    """Where the exporter puts a request's pages (state_transfer.connector_sink.ConnectorSink)."""

    def send_layers(self, req_id: str, layers: list[LayerPages], ready: torch.cuda.Event | None = None,
                    last: bool = False) -> None:
        """Some final layers of `req_id`, each layer once over all calls: host tensors, or with
        `device_pages` device tensors complete once `ready` is (and every earlier `ready` of the
        sink: they are recorded in order on one stream). `last`: no more layers of it follow (what
        is held of it may leave now, before its first token is sampled)."""

    def finish(self, request: RequestState) -> None:
        """The last call for a request: its state after the first token; all its layers came before."""

    def finish_pages(self, pages: StatePages) -> None:
        """Instead of layers + finish (per_layer=False): the whole request, state and pages, at once."""

    def cancel(self, req_id: str) -> None:
        """The request will not be finished (finished on its first token, aborted): drop it."""


@dataclass(slots=True)
class _Target:
    """A request whose last prefill chunk runs in this step."""

    req_id: str
    slot: int
    block_table: list[int]
    num_tokens: int  # tokens in its cache after this step (KV rows to export)


@dataclass(slots=True)
class _Staged:
    done: torch.cuda.Event  # recorded on the side stream after the copies
    pages: list[tuple[str, LayerPages]]  # host staging, complete once `done` is


class LayerExporter:
    def __init__(self, pool: CachePool, cache: CacheManager, sink: PageSink, per_layer: bool = True) -> None:
        self.pool = pool
        self.cache = cache
        self.sink = sink
        self.per_layer = per_layer
        self.cache_layers = frozenset(pool.ssm_index) | frozenset(pool.attn_index)
        self.side = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        # device staging handed over with its `ready` event (module docstring): what lets a
        # streaming step run in a prefill graph
        self.gated = self.side is not None and bool(getattr(sink, "device_pages", False))
        self._last_layer = max(self.cache_layers, default=-1)
        self._targets: list[_Target] = []
        self._step_tokens = 0  # prefill tokens of the step `begin` saw (its graph's length)
        self._staged: deque[_Staged] = deque()

    def begin(self, sched: SchedulerOutput) -> Callable[[int], None] | None:
        """The hook for this step's forward, or None if no request finishes its prefill in it (or
        the sink takes whole requests)."""
        if not self.per_layer:
            return None
        self._targets = [
            _Target(req.req_id, self.cache.slot(req.req_id), list(self.cache.block_table(req.req_id)) if
                    self.cache.uses_kv else [], req.num_computed_tokens + n)
            for req, n in sched.prefills
            if req.num_computed_tokens + n == req.num_tokens
        ]
        self._step_tokens = sum(n for _, n in sched.prefills)
        return self.layer_done if self._targets else None

    def graph_ran(self, layer_events: Mapping[int, torch.cuda.Event]) -> None:
        """The step ran in a prefill graph (just launched): the cache layers' copies, a stage of
        `graph_stage_layers` at a time behind the event the graph records after the last of them.
        Only for `gated` sinks: nothing here waits."""
        assert self.gated
        layers = sorted(self.cache_layers)
        per = graph_stage_layers(len(layers), self._step_tokens)
        for i in range(0, len(layers), per):
            group = layers[i : i + per]
            self._stage(group, layer_events[group[-1]])

    def layer_done(self, layer_idx: int) -> None:
        """Called by the model after decoder layer `layer_idx` of a streaming step."""
        if layer_idx not in self.cache_layers:
            return  # an MLP-only layer: no state
        if self.side is None:  # CPU: the forward ran synchronously, the pages are final now
            for t in self._targets:
                page = export_layer(self.pool, layer_idx, t.slot, t.block_table, t.num_tokens)
                self.sink.send_layers(t.req_id, [page])
            return
        self._stage([layer_idx], torch.cuda.current_stream(self.pool.device).record_event())

    def _stage(self, layer_ids: list[int], computed: torch.cuda.Event) -> None:
        """Snapshot `layer_ids` of every target on the side stream once `computed` is: to pinned host
        (handed over as their copies complete), or on the device (`gated`: handed over at once)."""
        assert self.side is not None
        staged: list[tuple[str, LayerPages]] = []
        outs: list[torch.Tensor] = []  # gated: the device snapshots, made by one batched copy
        srcs: list[torch.Tensor] = []
        with torch.cuda.stream(self.side):
            self.side.wait_event(computed)
            for layer_idx in layer_ids:
                ssm = layer_idx in self.pool.ssm_index
                for t in self._targets:
                    if ssm:  # straight from the slot: nothing writes it again before finish/cancel wait for us
                        kind, views = "ssm", {"conv": self.pool.conv(layer_idx)[t.slot], "ssm": self.pool.ssm(layer_idx)[t.slot]}
                    else:  # attention: the request's KV rows, gathered out of its blocks (a copy already)
                        page = export_layer(self.pool, layer_idx, t.slot, t.block_table, t.num_tokens)
                        kind, views = page.kind, page.tensors
                    if not self.gated:
                        views = {name: _pinned_copy(x) for name, x in views.items()}
                    elif ssm:
                        srcs += views.values()
                        views = {name: torch.empty(x.shape, dtype=x.dtype, device=x.device) for name, x in views.items()}
                        outs += views.values()
                    staged.append((t.req_id, LayerPages(layer_idx, kind, views)))
            if outs:
                torch._foreach_copy_(outs, srcs)  # NOTE: a few launches for all of them, not one per tensor
            done = self.side.record_event()
        if not self.gated:
            self._staged.append(_Staged(done, staged))
            self._hand_over(wait=False)
            return
        # handed over now: the sink's connector waits for `done` on the device
        last = layer_ids[-1] == self._last_layer
        by_req: dict[str, list[LayerPages]] = {}
        for req_id, page in staged:
            by_req.setdefault(req_id, []).append(page)
        for req_id, pages in by_req.items():
            self.sink.send_layers(req_id, pages, ready=done, last=last)
        self._staged.append(_Staged(done, []))  # finish / cancel still wait for the copies

    def finish(self, request: RequestState) -> None:
        """The request's first token is sampled: its remaining layers, then its state, to the sink."""
        if not self.per_layer:
            req_id = request.req_id
            table = list(self.cache.block_table(req_id)) if self.cache.uses_kv else []
            self.sink.finish_pages(export_pages(self.pool, request, self.cache.slot(req_id), table))
            return
        self._hand_over(wait=True)
        self._targets = [t for t in self._targets if t.req_id != request.req_id]
        self.sink.finish(request)

    def cancel(self, req_id: str) -> None:
        """Drop a request (finished at its first token, aborted); waits for its copies first."""
        self._hand_over(wait=True, skip=req_id)
        self._targets = [t for t in self._targets if t.req_id != req_id]
        self.sink.cancel(req_id)

    def _hand_over(self, wait: bool, skip: str | None = None) -> None:
        """Give the sink every completed snapshot, in order (with `wait`, every snapshot, waiting
        for its copies)."""
        ready: dict[str, list[LayerPages]] = {}  # NOTE: one hand-over per request, not per layer
        while self._staged:
            head = self._staged[0]
            if wait:
                head.done.synchronize()
            elif not head.done.query():
                break
            self._staged.popleft()
            for req_id, page in head.pages:
                if req_id != skip:
                    ready.setdefault(req_id, []).append(page)
        for req_id, pages in ready.items():
            self.sink.send_layers(req_id, pages)


def _pinned_copy(x: torch.Tensor) -> torch.Tensor:
    """Device -> pinned host, asynchronous on the current (side) stream."""
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host
