"""CUDA graphs for prefill-only steps: one captured forward per (token bucket, sequence bucket).

Why: eagerly, a prefill step launches about eleven kernels per layer, and at 64 layers the host
takes longer to launch them (about 31 ms for 2048 tokens of Mamba2-2.7B on an H200 host with direct
launches, about 40 ms through Triton's own launch path: benchmarks/RESULTS.md, session 17) than the
GPU takes to run them (about 26 ms).  Every kernel of the prefill path sizes its grid from shapes
alone and never reads a device value on the host (the SSD scan bounds its logical chunks by
`max_logical_chunks(T, S, Q)`; the conv and attention kernels search `cu_seqlens` on the device),
so a whole prefill forward can be captured once per shape and replayed.  A prefill worker's steps
are all of this kind; a colocated engine's steps that mix decodes and prefill chunks stay eager.

A step of S prefill chunks and T tokens runs in the graph of the first bucket (Tb, Sb) (smallest Tb
first, `prefill_buckets`) that holds it with room for its padding: the real sequences come first, unchanged; the
Tb - T padding tokens form the Sb - S padding sequences, each of at least one token, at positions
from 0, without initial state, in the scratch slot (shared: its contents are garbage by design),
writing no KV (slot_mapping -1) and reading block 0 (read-only).  So a bucket fits when
S <= Sb, T <= Tb and either T == Tb and S == Sb, or 1 <= Sb - S <= Tb - T.

Static inputs (their addresses are baked into every graph):

  tokens        [3 * Tmax] int64   per bucket, three rows of Tb: input_ids, positions, slot_mapping
  seqs          [4 * Smax + 1] int32 per bucket: query_start_loc [Sb + 1], context_lens [Sb],
                                   seq_lens [Sb], state_indices [Sb] (has_initial_state is
                                   context_lens > 0, computed inside the graph)
  block_tables  [Smax, W] int32    W = max_model_len / block_size (1 for pure SSM)

The output is the graph's own hidden-state tensor [Tb, hidden] (memory of the graphs' pool, valid
until the next replay); the runner gathers the rows it samples and computes their logits eagerly.
`ForwardMeta`'s host lists inside a graph are placeholders (`host_lists=False`): the Triton prefill
path reads only `query_start_loc_cpu[0]`, which is 0 in every bucket, and `max_query_len` is None
there, so the SSD scan picks its state path from the bucket's tokens and sequences
(ssd_plan.use_serial_states). (Until session 26 the placeholders read as a longest sequence of 0
tokens, which sent every bucket down the serial path, 1.4x slower for one sequence of 8192.)

Layer events (`layer_events`): every graph records one external CUDA event after each decoder
layer (a record node: the graph's only link to the host is its launch, so this is how work outside
it learns that a layer is done). Every bucket records the same events; the last replay launched is
the one a stream waiting on them waits for. A prefill worker streaming pages layer by layer
(layer_export.py) makes its copies wait on them, so a graph prefill streams as an eager one does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from pd_ssm.cache.pool import CachePool
from pd_ssm.engine.cuda_graphs import capture_graph
from pd_ssm.engine.forward_meta import ForwardMeta
from pd_ssm.engine.host_copy import copy_from_host
from pd_ssm.models.base import CausalLM

_TOKEN_ROWS = 3  # input_ids, positions, slot_mapping
TOKEN_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)
SEQ_BUCKETS = (1, 4, 16)
MAX_SEQS = 16  # more prefill chunks in one step than this run eagerly


def prefill_buckets(max_tokens: int, max_seqs: int) -> list[tuple[int, int]]:
    """The (tokens, sequences) buckets to capture, in the order `PrefillGraphs.bucket` tries them.

    Token buckets: the defaults below `max_tokens`, and `max_tokens` itself.  With c =
    min(max_seqs, MAX_SEQS): the smaller token buckets take the default sequence buckets up to c
    and c + 1; the largest one every count 1 .. c + 1, because a step of exactly `max_tokens`
    (what chunked prefill makes of long prompts) fits only a bucket of exactly its sequence count,
    and one short of it only a bucket with one more.  Together: every step of <= c chunks fits.
    """
    if max_tokens <= 0 or max_seqs <= 0:
        raise ValueError("max_tokens and max_seqs must be > 0")
    cap = min(max_seqs, MAX_SEQS)
    small = sorted({s for s in SEQ_BUCKETS if s <= cap} | {cap + 1})
    tokens = [t for t in TOKEN_BUCKETS if t < max_tokens]
    buckets = [(t, s) for t in tokens for s in small if s <= t]
    return buckets + [(max_tokens, s) for s in range(1, cap + 2) if s <= max_tokens]


def fits(num_tokens: int, num_seqs: int, bucket: tuple[int, int]) -> bool:
    """Whether a step of `num_tokens` in `num_seqs` chunks pads into `bucket` (module docstring)."""
    tb, sb = bucket
    if not (0 < num_seqs <= sb and 0 < num_tokens <= tb):
        return False
    pad_tokens, pad_seqs = tb - num_tokens, sb - num_seqs
    return pad_tokens == pad_seqs == 0 or 1 <= pad_seqs <= pad_tokens


class VarlenRows(NamedTuple):
    """Host values of a prefill-only step (what the runner reads off its requests)."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T], -1 for pure SSM models
    query_start_loc: list[int]  # [S + 1]
    context_lens: list[int]  # [S]
    state_indices: list[int]  # [S]
    block_tables: list[list[int]]  # [S][blocks], [] per sequence for pure SSM models


@dataclass(slots=True)
class PaddedPrefill:
    tokens: list[int]  # [3 * Tb]
    seqs: list[int]  # [4 * Sb + 1]
    tables: list[list[int]]  # [Sb][w], padded with 0 to the widest real table (w may be 0)
    width: int


def pad_prefill(rows: VarlenRows, bucket: tuple[int, int], *, scratch_slot: int, max_width: int) -> PaddedPrefill:
    """Pad a step to `bucket`: padding sequences of >= 1 token each in the scratch slot, no KV."""
    tb, sb = bucket
    t, s = len(rows.input_ids), len(rows.context_lens)
    if not fits(t, s, bucket):
        raise ValueError(f"a prefill step of {t} tokens in {s} sequences does not pad into bucket {bucket}")
    width = max((len(tab) for tab in rows.block_tables), default=0)
    if width > max_width:
        raise ValueError(f"a block table of {width} blocks exceeds the graphs' width {max_width}")
    pad_t, pad_s = tb - t, sb - s
    # padding sequence lengths: the first takes what the others (one token each) leave
    pad_lens = [pad_t - (pad_s - 1)] + [1] * (pad_s - 1) if pad_s else []
    qsl = list(rows.query_start_loc)
    for n in pad_lens:
        qsl.append(qsl[-1] + n)
    pad_positions = [p for n in pad_lens for p in range(n)]
    ctx = [*rows.context_lens, *[0] * pad_s]
    seq_lens = [c + (qsl[i + 1] - qsl[i]) for i, c in enumerate(ctx)]
    tokens = [
        *rows.input_ids, *[0] * pad_t,
        *rows.positions, *pad_positions,
        *rows.slot_mapping, *[-1] * pad_t,
    ]
    seqs = [*qsl, *ctx, *seq_lens, *rows.state_indices, *[scratch_slot] * pad_s]
    tables = [tab + [0] * (width - len(tab)) for tab in rows.block_tables] + [[0] * width] * pad_s if width else []
    return PaddedPrefill(tokens, seqs, tables, width)


class PrefillBuffers:
    """The static inputs of every prefill graph, sized for the largest buckets."""

    def __init__(self, max_tokens: int, max_seqs: int, width: int, device: torch.device) -> None:
        self.tokens = torch.zeros(_TOKEN_ROWS * max_tokens, dtype=torch.int64, device=device)
        self.seqs = torch.zeros(4 * max_seqs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs, width, dtype=torch.int32, device=device)

    def fill(self, padded: PaddedPrefill, bucket: tuple[int, int]) -> None:
        """Two host->device copies (three with KV tables), none waiting for the GPU (host_copy.py)."""
        tb, sb = bucket
        copy_from_host(self.tokens[: _TOKEN_ROWS * tb], torch.tensor(padded.tokens, dtype=torch.int64))
        copy_from_host(self.seqs[: 4 * sb + 1], torch.tensor(padded.seqs, dtype=torch.int32))
        if padded.width:
            host = torch.tensor(padded.tables, dtype=torch.int32)  # [Sb, w]
            copy_from_host(self.block_tables[:sb, : padded.width], host)
            self.block_tables[:sb, padded.width :].zero_()

    def inputs(self, bucket: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, ForwardMeta]:
        """(input_ids, positions, meta) of a bucket, views and device ops on the buffers only."""
        tb, sb = bucket
        ids, positions, slot_mapping = self.tokens[: _TOKEN_ROWS * tb].view(_TOKEN_ROWS, tb).unbind(0)
        qsl, ctx, seq_lens, slots = self.seqs[: 4 * sb + 1].split([sb + 1, sb, sb, sb])
        meta = ForwardMeta(
            num_decodes=0,
            num_prefills=sb,
            num_tokens=tb,
            query_start_loc=qsl,
            context_lens=ctx,
            seq_lens=seq_lens,
            state_indices=slots,
            has_initial_state=ctx > 0,
            slot_mapping=slot_mapping,
            block_tables=self.block_tables[:sb],
            # capture-time placeholders (module docstring): only element 0 is read, and it is 0
            query_start_loc_cpu=[0] * (sb + 1),
            context_lens_cpu=[0] * sb,
            seq_lens_cpu=[0] * sb,
            host_lists=False,
        )
        return ids, positions, meta


class PrefillGraphs:
    """Captured prefill steps over one set of static buffers and one memory pool.

    `capture=False` runs the same body eagerly through the static buffers (what the CPU tests use to
    check padding against the plain eager path)."""

    def __init__(
        self,
        model: CausalLM,
        pool: CachePool,
        *,
        buckets: Sequence[tuple[int, int]],
        scratch_slot: int,
        width: int,
        capture: bool = True,
        layer_events: bool = True,
    ) -> None:
        if not buckets or any(not 0 < sb <= tb for tb, sb in buckets) or len(set(buckets)) != len(buckets):
            raise ValueError(f"prefill buckets must be distinct (tokens, sequences) with 0 < sequences <= tokens, "
                             f"got {list(buckets)}")
        if not 0 <= scratch_slot < pool.num_slots:
            raise ValueError(f"scratch slot {scratch_slot} is outside the pool's {pool.num_slots} slots")
        self.model = model
        self.pool = pool
        self.buckets = list(buckets)  # `bucket` takes the first that fits: order them by padding cost
        self.scratch_slot = scratch_slot
        self.width = width
        self.buffers = PrefillBuffers(max(b[0] for b in buckets), max(b[1] for b in buckets), width, pool.device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.replays = 0
        # layer index -> the event every graph records after that layer (module docstring); made
        # while the first bucket warms up, before any capture
        self.layer_events: dict[int, torch.cuda.Event] | None = (
            {} if layer_events and capture and pool.device.type == "cuda" else None
        )
        if capture:
            self._capture()

    def bucket(self, num_tokens: int, num_seqs: int) -> tuple[int, int] | None:
        """The bucket a step runs in, or None when none holds it (the step runs eagerly)."""
        return next((b for b in self.buckets if fits(num_tokens, num_seqs, b)), None)

    def _body(self, bucket: tuple[int, int]) -> torch.Tensor:
        ids, positions, meta = self.buffers.inputs(bucket)
        if self.layer_events is not None:
            meta.on_layer = self._record
        return self.model(ids, positions, meta, self.pool)  # [Tb, hidden]

    def _record(self, layer_idx: int) -> None:
        assert self.layer_events is not None
        event = self.layer_events.get(layer_idx)
        if event is None:  # external: a record node when captured, not an edge inside the graph
            event = self.layer_events[layer_idx] = torch.cuda.Event(external=True)
        event.record()

    def _padding_only(self, bucket: tuple[int, int]) -> None:
        """Make a bucket all padding (what warm-up and capture run on: only the scratch slot moves):
        one sequence in the scratch slot writing no KV, then the bucket's one-token padding."""
        tb, sb = bucket
        n = tb - (sb - 1)
        rows = VarlenRows([0] * n, list(range(n)), [-1] * n, [0, n], [0], [self.scratch_slot], [[]])
        self.buffers.fill(pad_prefill(rows, bucket, scratch_slot=self.scratch_slot, max_width=self.width), bucket)
        self.buffers.block_tables[:sb].zero_()

    @torch.inference_mode()
    def _capture(self) -> None:
        t0 = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        # largest first: the smaller graphs then fit in the memory the largest one left in the pool
        for bucket in reversed(self.buckets):

            def warm_up(b: tuple[int, int] = bucket) -> None:
                self._padding_only(b)
                self._body(b)

            self.graphs[bucket], self.outputs[bucket] = capture_graph(
                warm_up, partial(self._body, bucket), mempool, self.pool.device,
                f"the prefill step for bucket {bucket} (tokens, sequences)",
            )
        torch.cuda.synchronize(self.pool.device)
        self.capture_seconds = time.perf_counter() - t0

    def run(self, rows: VarlenRows) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's real tokens (a view of the graph's output, valid
        until the next call); raises ValueError when no bucket holds the step (check `bucket`)."""
        t, s = len(rows.input_ids), len(rows.context_lens)
        bucket = self.bucket(t, s)
        if bucket is None:
            raise ValueError(f"no prefill bucket holds {t} tokens in {s} sequences")
        self.buffers.fill(pad_prefill(rows, bucket, scratch_slot=self.scratch_slot, max_width=self.width), bucket)
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
            out = self.outputs[bucket]
        else:
            out = self._body(bucket)
        self.replays += 1
        return out[:t]
