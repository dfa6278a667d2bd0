"""CUDA graphs for decode-only steps: one captured model step per batch-size bucket.

A decode step of B sequences (no prefill in the batch, B <= the largest bucket) is padded to the
smallest bucket P >= B, its inputs are copied into static buffers, and the graph captured for P
replays the whole model step: embedding -> every layer -> final norm -> logits of all P rows.
Sampling stays outside the graph (it syncs with the host and its shapes depend on the params).

Static inputs, the graph's only inputs (their addresses are baked into every graph):

  stage         [9 * M] int32   per bucket P, six rows of P values laid end to end: three int64
                                rows (input_ids, positions, slot_mapping: 6P int32 words, read
                                through an int64 view), then three int32 rows (context_lens,
                                seq_lens, state_indices), so one host->device copy feeds a step
                                and the graph casts nothing (each cast was a launch of its own)
  block_tables  [M, W] int32    W = max_model_len / block_size (1 for pure SSM), padded with 0
  logits        [M, V] fp32     output: the graph copies its logits here

Padding rows never touch a live request: their state index is the scratch slot (one pool slot
that the CacheManager never hands out), their slot_mapping is -1 (no KV write), their sequence
length 1 over block 0 (read-only).  Every padding row shares the scratch slot, so the scratch's
contents are garbage by design.

NOTE: `ForwardMeta`'s host lists (`*_cpu`) inside a graph describe the capture-time batch, not the
replayed one; the decode path reads none of them (its kernels take device metadata only), which
is part of what makes it capturable.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, TypeVar

import torch

from pd_ssm.cache.pool import CachePool
from pd_ssm.config import ModelConfig
from pd_ssm.engine.forward_meta import ForwardMeta
from pd_ssm.engine.host_copy import copy_from_host
from pd_ssm.engine.inflight import TokenFeed
from pd_ssm.kernels.dispatch import Kernels
from pd_ssm.models.base import CausalLM

# vLLM's default ceiling: beyond it a decode batch runs eagerly (launch overhead is amortized)
MAX_CAPTURE_SIZE = 256
# int32 words of the stage per row of a bucket: input_ids, positions, slot_mapping as int64 (two
# words each), context_lens, seq_lens, state_indices as int32
_STAGE_WORDS = 9


class GraphCaptureError(RuntimeError):
    """A step cannot be captured; the message says what to change."""


_Out = TypeVar("_Out")


def capture_graph(
    warm_up: Callable[[], object], body: Callable[[], _Out], mempool: Any, device: torch.device, what: str
) -> tuple[torch.cuda.CUDAGraph, _Out]:
    """Run `warm_up` eagerly (kernel compilation, cuBLAS workspaces), then capture `body` into a new
    graph on `mempool`; returns the graph and what `body` returned (tensors of the graph's pool).
    Any failure is a GraphCaptureError naming `what` (the decode and the prefill graphs share this)."""
    try:
        warm_up()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            out = body()
    except RuntimeError as e:
        raise GraphCaptureError(
            f"capturing {what} failed ({e}); a kernel that synchronizes with the host or allocates by data "
            "cannot be captured. Pass enforce_eager=True (--enforce-eager)"
        ) from e
    return graph, out


def capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Buckets 1, 2, 4, 8, 16, 24, 32, 48, 64, 80, ... (steps of 16 past 32), capped at
    min(max_num_seqs, max_size), which is always a bucket itself (no padding past max_num_seqs)."""
    if max_num_seqs <= 0 or max_size <= 0:
        raise ValueError("max_num_seqs and max_size must be > 0")
    cap = min(max_num_seqs, max_size)
    pattern = [1, 2, 4, 8, 16, 24, 32, *range(48, max_size + 1, 16)]
    return sorted({s for s in pattern if s < cap} | {cap})


def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds n rows (sizes sorted ascending); None if n is too large."""
    if n <= 0:
        raise ValueError(f"a decode batch has at least one sequence, got {n}")
    i = bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def table_width(max_model_len: int, block_size: int, uses_kv: bool) -> int:
    """Fixed block-table width of the graphs: enough blocks for max_model_len tokens."""
    return -(-max_model_len // block_size) if uses_kv else 1


class DecodeRows(NamedTuple):
    """Host values of a decode batch, one entry per sequence (what the runner reads off requests)."""

    input_ids: list[int]
    positions: list[int]  # = context length: the position of the token fed this step
    slot_mapping: list[int]  # KV slot of the token, -1 for pure SSM models
    state_indices: list[int]
    block_tables: list[list[int]]  # [] per row for pure SSM models


@dataclass(slots=True)
class PaddedDecode:
    """A decode batch padded to its bucket, in the layout of the static buffers."""

    num_rows: int  # B, real sequences (the first B rows)
    size: int  # P, the bucket
    stage: list[int]  # [6 * P]: the six rows of `stage` (module docstring), each P long
    tables: list[list[int]]  # [P][w]: block tables padded with 0 to the widest real row
    width: int  # w, widest real block table (0 for pure SSM: the static table is never written)


def pad_decode(rows: DecodeRows, size: int, *, scratch_slot: int, max_width: int) -> PaddedDecode:
    """Pad B decode rows to `size` rows; padding rows use the scratch slot and write no KV."""
    b = len(rows.input_ids)
    if not 0 < b <= size:
        raise ValueError(f"cannot pad {b} decode rows to a bucket of {size}")
    pad = size - b
    width = max((len(t) for t in rows.block_tables), default=0)
    if width > max_width:
        raise ValueError(f"a block table of {width} blocks exceeds the graphs' width {max_width}")
    ctx = rows.positions
    stage = [
        *rows.input_ids, *[0] * pad,
        *rows.positions, *[0] * pad,
        *rows.slot_mapping, *[-1] * pad,
        *ctx, *[0] * pad,  # context_lens
        *[c + 1 for c in ctx], *[1] * pad,  # seq_lens
        *rows.state_indices, *[scratch_slot] * pad,
    ]
    tables = [t + [0] * (width - len(t)) for t in rows.block_tables] + [[0] * width] * pad if width else []
    return PaddedDecode(num_rows=b, size=size, stage=stage, tables=tables, width=width)


def pack_stage(stage: list[int], size: int) -> torch.Tensor:
    """The six rows of a bucket's stage (PaddedDecode.stage) as `DecodeBuffers.stage` holds them:
    [9 * size] int32, the first three rows as int64 words, the last three as int32."""
    wide = torch.tensor(stage[: 3 * size], dtype=torch.int64).view(torch.int32)  # [6 * size]
    return torch.cat([wide, torch.tensor(stage[3 * size :], dtype=torch.int32)])


class DecodeBuffers:
    """The static inputs and output of the captured steps, sized for the largest bucket M."""

    def __init__(self, max_size: int, width: int, vocab_size: int, device: torch.device) -> None:
        self.max_size = max_size
        self.width = width
        self.stage = torch.zeros(_STAGE_WORDS * max_size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_size, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)  # constant
        self.logits = torch.zeros(max_size, vocab_size, dtype=torch.float32, device=device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.stage, self.block_tables, self.query_start_loc,
                                                          self.logits))

    def fill(self, padded: PaddedDecode) -> None:
        """Copy a padded batch into the buffers: one host->device copy (two with KV tables)."""
        p = padded.size
        copy_from_host(self.stage[: _STAGE_WORDS * p], pack_stage(padded.stage, p))
        if padded.width:
            host = torch.tensor(padded.tables, dtype=torch.int32)  # [P, w]
            copy_from_host(self.block_tables[:p, : padded.width], host)
            # NOTE: entries past a row's last block are ignored by the kernels; zeroed all the same
            self.block_tables[:p, padded.width :].zero_()

    def pad_with_scratch(self, size: int, scratch_slot: int) -> None:
        """Make bucket `size` all padding rows (what warm-up and capture run on: only the scratch
        slot moves).  NOTE: each bucket reads its own layout (six rows of `size`), so this is per size."""
        rows = [0] * size + [0] * size + [-1] * size + [0] * size + [1] * size + [scratch_slot] * size
        self.stage[: _STAGE_WORDS * size].copy_(pack_stage(rows, size))
        self.block_tables[:size].zero_()

    def input_ids(self, size: int) -> torch.Tensor:
        """[P] int64, bucket `size`'s input ids (a view: what a token feed writes)."""
        return self.stage[: 2 * size].view(torch.int64)

    def inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, ForwardMeta]:
        """(input_ids, positions, meta) of bucket `size`, derived from the buffers by device ops
        only: inside a graph they are recomputed from the buffers at every replay."""
        wide = self.stage[: 6 * size].view(torch.int64).view(3, size)
        ids, positions, slot_mapping = wide.unbind(0)  # [P] int64 each
        ctx, seq, slots = self.stage[6 * size : _STAGE_WORDS * size].view(3, size).unbind(0)  # [P] int32 each
        meta = ForwardMeta(
            num_decodes=size,
            num_prefills=0,
            num_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=ctx,
            seq_lens=seq,
            state_indices=slots,
            has_initial_state=ctx > 0,
            slot_mapping=slot_mapping,
            block_tables=self.block_tables[:size],
            # capture-time placeholders, never read on the decode path (module docstring)
            query_start_loc_cpu=list(range(size + 1)),
            context_lens_cpu=[0] * size,
            seq_lens_cpu=[1] * size,
            host_lists=False,
        )
        return ids, positions, meta


def decode_step(model: CausalLM, pool: CachePool, buffers: DecodeBuffers, size: int) -> None:
    """The captured body: one model step over bucket `size` of the buffers, logits into buffers.logits."""
    ids, positions, meta = buffers.inputs(size)
    hidden = model(ids, positions, meta, pool)  # [P, hidden]
    model.compute_logits(hidden, out=buffers.logits[:size])


def check_capturable(kernels: Kernels, model_config: ModelConfig) -> None:
    """Refuse, before any work, a combination known to break capture."""
    if kernels.backend == "torch" and model_config.attention_layer_ids:
        raise GraphCaptureError(
            "CUDA graphs cannot capture the decode step of a hybrid model on kernel_backend='torch': the "
            "reference write_kv_cache skips slot -1 by boolean masking, which synchronizes with the host. "
            "Pass enforce_eager=True (--enforce-eager), or use the Triton kernels"
        )


class DecodeGraphs:
    """Captured decode steps, one per bucket, over one set of static buffers and one memory pool.

    `capture=False` runs the very same body eagerly through the static buffers (no graph): what
    the CPU tests use to check padding and buffer filling against the plain eager path.
    """

    def __init__(
        self,
        model: CausalLM,
        pool: CachePool,
        *,
        sizes: Sequence[int],
        scratch_slot: int,
        width: int,
        capture: bool = True,
    ) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"capture sizes must be distinct and ascending, got {list(sizes)}")
        if not 0 <= scratch_slot < pool.num_slots:
            raise ValueError(f"scratch slot {scratch_slot} is outside the pool's {pool.num_slots} slots")
        self.model = model
        self.pool = pool
        self.sizes = list(sizes)
        self.scratch_slot = scratch_slot
        self.width = width
        self.buffers = DecodeBuffers(self.sizes[-1], width, model.config.vocab_size, pool.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.replays = 0  # steps served (by a graph, or by the eager body when capture=False)
        if capture:
            self._capture()
        else:
            self._dry_run()

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, num_decodes: int) -> bool:
        return 0 < num_decodes <= self.max_size

    @torch.inference_mode()
    def _capture(self) -> None:
        t0 = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        # largest first: the smaller graphs then fit in the memory the largest one left in the pool
        for size in reversed(self.sizes):
            self.graphs[size], _ = capture_graph(
                partial(self._padding_step, size),
                partial(decode_step, self.model, self.pool, self.buffers, size),
                mempool, self.pool.device, f"the decode step for batch {size}",
            )
        torch.cuda.synchronize(self.pool.device)
        self.capture_seconds = time.perf_counter() - t0

    @torch.inference_mode()
    def _dry_run(self) -> None:
        """Without capture, the same warm-up steps `_capture` runs (tests check they move only the scratch slot)."""
        for size in reversed(self.sizes):
            self._padding_step(size)

    def _padding_step(self, size: int) -> None:
        self.buffers.pad_with_scratch(size, self.scratch_slot)
        decode_step(self.model, self.pool, self.buffers, size)

    def run(self, rows: DecodeRows, feed: TokenFeed | None = None) -> torch.Tensor:
        """Logits [B, vocab] fp32 of B decode rows: a view of the static buffer, valid until the
        next call.  `feed` writes the rows' tokens that are still on the device (async scheduling)."""
        b = len(rows.input_ids)
        size = bucket_for(b, self.sizes)
        if size is None:
            raise ValueError(f"{b} decode rows exceed the largest captured batch {self.max_size}")
        padded = pad_decode(rows, size, scratch_slot=self.scratch_slot, max_width=self.width)
        self.buffers.fill(padded)
        if feed is not None:
            feed.apply(self.buffers.input_ids(size))
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            decode_step(self.model, self.pool, self.buffers, size)
        self.replays += 1
        return self.buffers.logits[:b]
