"""Model runner: turns a SchedulerOutput into tensors, runs the model, samples.

Host-side metadata is built in Python lists once per step and copied to the device in one go per
tensor; the model sees only `ForwardMeta`.  Logits are computed only for the sequences whose
pending tokens are all fed this step (the others are mid-prefill and sample nothing).

Decode-only steps go through `graphs` (cuda_graphs.DecodeGraphs) when the engine captured them and
the batch fits the largest bucket, prefill-only steps through `prefill_graphs`
(prefill_graphs.PrefillGraphs) when a bucket holds them.  A step that mixes decodes and prefill
chunks (a colocated engine admitting a prompt while others decode) runs as its two halves, the
prefill chunks' graph and then the decodes' graph, when both have one: every sequence's state is
its own (no layer mixes rows of different sequences but the linears, which compute each row alone),
so the halves compute what one mixed forward does, and exactly what a disaggregated deployment's
prefill and decode workers compute.  Eagerly, such a step took 0.1-0.2 s at Mamba2-2.7B shape on
an H200 with 30-40 requests held, and ~1 s more where Triton first met a new specialization of
the eager path; served through the two graphs, every step of that workload stayed under 18 ms
(p99; benchmarks/RESULTS.md, session 29).  Everything else (every step on the CPU, with enforce_eager,
or beyond the buckets) runs eagerly.  All paths return the same logits for the same batch.

`launch` queues a step and its sampling without reading anything back (the sampled tokens stay on
the device until the engine reads them, device_sample.py).  A decode row whose input token is still on
the device (async scheduling, inflight.py) gets it through a TokenFeed, copied on the device into
the step's input ids after the host values are in place.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pd_ssm.cache.manager import CacheManager
from pd_ssm.cache.pool import CachePool
from pd_ssm.engine.cuda_graphs import DecodeGraphs, DecodeRows
from pd_ssm.engine.device_sample import DeviceSample
from pd_ssm.engine.forward_meta import ForwardMeta
from pd_ssm.engine.inflight import InflightStep, TokenFeed, token_feed
from pd_ssm.engine.layer_export import LayerExporter
from pd_ssm.engine.prefill_graphs import PrefillGraphs, VarlenRows
from pd_ssm.engine.request import Request
from pd_ssm.engine.sampler import Sampler
from pd_ssm.engine.schedule_types import ScheduledSeq, SchedulerOutput
from pd_ssm.models.base import CausalLM


def _sampling(seqs: list[ScheduledSeq]) -> list[Request]:
    """The requests of `seqs` that sample this step: those whose pending tokens are all fed."""
    return [seq.request for seq in seqs if seq.request.num_computed_tokens + seq.num_new_tokens
            == seq.request.num_tokens]


class Launched(NamedTuple):
    """A queued step: the requests that sample (row order) and their tokens, still on the device."""

    reqs: list[Request]
    sample: DeviceSample | None  # None when no request samples this step


class ModelRunner:
    def __init__(self, model: CausalLM, pool: CachePool, cache: CacheManager, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.cache = cache
        self.device = device
        self.sampler = Sampler(argmax=model.kernels.greedy_argmax)
        self.graphs: DecodeGraphs | None = None  # set by the engine after capture (CUDA only)
        # prefill role: ships the pages of prefills that finish in a step, layer by layer (eager)
        self.layer_export: LayerExporter | None = None
        self.prefill_graphs: PrefillGraphs | None = None  # likewise, for prefill-only steps
        self.split_steps = 0  # mixed steps run as a prefill graph and a decode graph

    def host_rows(self, sched: SchedulerOutput) -> tuple[VarlenRows, list[int]]:
        """Host values of the step (decodes first, then prefill chunks) and the flat rows that sample."""
        ids: list[int] = []
        positions: list[int] = []
        qsl = [0]
        ctx: list[int] = []
        slots: list[int] = []
        slot_mapping: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        bs = self.cache.block_size
        uses_kv = self.cache.uses_kv
        for req, n in sched.seqs:
            start = req.num_computed_tokens
            ids.extend(req.pending_token_ids(n))
            positions.extend(range(start, start + n))
            qsl.append(qsl[-1] + n)
            ctx.append(start)
            slots.append(self.cache.slot(req.req_id))
            if uses_kv:
                table = self.cache.block_table(req.req_id)
                tables.append(table)
                slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            else:
                tables.append([])
            if start + n == req.num_tokens:
                sample_rows.append(qsl[-1] - 1)
        if not uses_kv:
            slot_mapping = [-1] * len(ids)
        return VarlenRows(ids, positions, slot_mapping, qsl, ctx, slots, tables), sample_rows

    def build(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, ForwardMeta, list[int]]:
        """(input_ids, positions, meta, rows to sample) for the step."""
        rows, sample_rows = self.host_rows(sched)
        qsl, ctx = rows.query_start_loc, rows.context_lens
        seq_lens = [c + (qsl[i + 1] - qsl[i]) for i, c in enumerate(ctx)]
        width = max((len(t) for t in rows.block_tables), default=0) or 1
        padded = [t + [0] * (width - len(t)) for t in rows.block_tables]
        dev = self.device

        def i32(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int32, device=dev)

        meta = ForwardMeta(
            num_decodes=len(sched.decodes),
            num_prefills=len(sched.prefills),
            num_tokens=len(rows.input_ids),
            query_start_loc=i32(qsl),
            context_lens=i32(ctx),
            seq_lens=i32(seq_lens),
            state_indices=i32(rows.state_indices),
            has_initial_state=torch.tensor([c > 0 for c in ctx], dtype=torch.bool, device=dev),
            slot_mapping=torch.tensor(rows.slot_mapping, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev).reshape(len(ctx), width),
            query_start_loc_cpu=qsl,
            context_lens_cpu=ctx,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.tensor(rows.input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(rows.positions, dtype=torch.int64, device=dev)
        return input_ids, pos, meta, sample_rows

    def decode_rows(self, decodes: list[ScheduledSeq]) -> DecodeRows:
        """Host values of a decode-only batch (what `build` computes, without the generality)."""
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        bs = self.cache.block_size
        uses_kv = self.cache.uses_kv
        for req, _ in decodes:
            pos = req.num_computed_tokens  # the one pending token is the last one
            # NOTE: a token in flight is not on the host yet: its row gets it from a TokenFeed
            ids.append(-1 if req.num_inflight else
                       req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1])
            positions.append(pos)
            slots.append(self.cache.slot(req.req_id))
            if uses_kv:
                table = self.cache.block_table(req.req_id)
                tables.append(table)
                slot_mapping.append(table[pos // bs] * bs + pos % bs)
            else:
                tables.append([])
                slot_mapping.append(-1)
        return DecodeRows(ids, positions, slot_mapping, slots, tables)

    @torch.inference_mode()
    def forward_logits(self, sched: SchedulerOutput, feed: TokenFeed | None = None) -> tuple[torch.Tensor, list[Request]]:
        """Run the step; return [N, vocab] fp32 logits for the N requests that sample, and them."""
        if self.graphs is not None and not sched.prefills and self.graphs.can_run(len(sched.decodes)):
            # every decode row samples: its one pending token is fed
            return self.graphs.run(self.decode_rows(sched.decodes), feed), [seq.request for seq in sched.decodes]
        if feed is not None and sched.prefills:
            raise RuntimeError("tokens in flight feed decode-only steps; this step has prefill chunks")
        # per-layer export of the prefills that finish in this step: a hook in an eager forward, or
        # after a graph prefill, copies gated on the graph's layer events (device staging only)
        stream = self.layer_export.begin(sched) if self.layer_export is not None else None
        if stream is None and self._splits(sched):
            return self._split_step(sched)
        pg = self.prefill_graphs
        if (pg is not None and not sched.decodes and pg.bucket(sched.num_tokens, len(sched.prefills)) is not None
                and (stream is None or (pg.layer_events is not None and self.layer_export is not None
                                        and self.layer_export.gated))):
            host, rows = self.host_rows(sched)
            hidden = pg.run(host)
            if stream is not None:
                assert self.layer_export is not None and pg.layer_events is not None
                self.layer_export.graph_ran(pg.layer_events)
        else:
            input_ids, positions, meta, rows = self.build(sched)
            if feed is not None:
                feed.apply(input_ids)  # decodes come first: decode row i is input row i
            meta.on_layer = stream
            hidden = self.model(input_ids, positions, meta, self.pool)
        sampling = _sampling(sched.seqs)
        if not rows:
            return torch.empty(0, device=self.device), []
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        return logits, sampling

    def _splits(self, sched: SchedulerOutput) -> bool:
        """Whether a mixed step runs as its prefill graph and its decode graph (module docstring)."""
        pg = self.prefill_graphs
        return (bool(sched.decodes) and bool(sched.prefills) and self.graphs is not None and pg is not None
                and self.graphs.can_run(len(sched.decodes))
                and pg.bucket(sum(s.num_new_tokens for s in sched.prefills), len(sched.prefills)) is not None)

    def _split_step(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        assert self.graphs is not None and self.prefill_graphs is not None
        # NOTE: the prefill half first, and its logits out of the graph's memory before the decode
        # graph replays; the decode graph's logits (its static buffer) are copied by the cat
        host, rows = self.host_rows(SchedulerOutput(prefills=sched.prefills))
        hidden = self.prefill_graphs.run(host)
        sampling = _sampling(sched.seqs)  # every decode row, first, then the prefills that finish
        prefill_logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]) if rows else None
        decode_logits = self.graphs.run(self.decode_rows(sched.decodes))
        self.split_steps += 1
        return torch.cat([decode_logits, prefill_logits]) if prefill_logits is not None else decode_logits, sampling

    def launch(self, sched: SchedulerOutput, inflight: InflightStep | None = None) -> Launched:
        """Queue the step and its sampling; nothing is read back.  Decode rows of requests with a
        token in flight take it from `inflight` on the device."""
        feed = token_feed([seq.request for seq in sched.decodes], inflight)
        logits, reqs = self.forward_logits(sched, feed)
        if not reqs:
            return Launched([], None)
        sample = self.sampler.sample(
            logits,
            [r.params for r in reqs],
            [r.seed for r in reqs],
            [r.sample_offset for r in reqs],
        )
        return Launched(reqs, sample)
