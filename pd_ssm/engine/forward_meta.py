"""ForwardMeta: what one model step needs to know about the batch, as tensors.

The scheduler decides *which* tokens run (pure Python); the runner turns that into this object;
every layer reads it.  Sequences are ordered **decodes first, then prefills**: the first
`num_decodes` sequences contribute exactly one token each (flattened tokens `[0, num_decodes)`),
the rest are prefill chunks of any length laid end to end (varlen).  A prefill chunk continues
from the sequence's own state (`has_initial_state`) and may begin at any position, also in the
middle of an SSM chunk (`context_lens % chunk_size != 0`).

Device tensors feed the kernels; the `*_cpu` lists are the same values on the host, so the
Python side (and the torch reference kernels) never synchronize with the device to read them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class ForwardMeta:
    num_decodes: int  # sequences (and tokens) at the front of the batch that decode one token
    num_prefills: int  # sequences after them, each a prefill chunk
    num_tokens: int  # T, all tokens of the step
    query_start_loc: torch.Tensor  # [S+1] int32, token offsets of each sequence in the flat batch
    context_lens: torch.Tensor  # [S] int32, tokens already in the cache before this step
    seq_lens: torch.Tensor  # [S] int32, context_lens + tokens of this step
    state_indices: torch.Tensor  # [S] int32, state-pool slot of each sequence
    has_initial_state: torch.Tensor  # [S] bool, context_lens > 0
    slot_mapping: torch.Tensor  # [T] int64, KV-cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # [S, max_blocks] int32, KV blocks per sequence (padded with 0)
    query_start_loc_cpu: list[int]
    context_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # called by the model after each decoder layer (its index) on steps that stream pages out
    # (layer_export.py); None on every other step, and inside CUDA graphs
    on_layer: Callable[[int], None] | None = field(default=None, repr=False, compare=False)
    # False inside a captured prefill graph: the *_cpu lists are the capture's placeholders, not the
    # batch of any replay (prefill_graphs.py), so nothing may be chosen from them
    host_lists: bool = True
    # NOTE: every SSM and attention layer asks for the same two views; built once per step
    _prefill: ForwardMeta | None = field(default=None, init=False, repr=False, compare=False)
    _decode: ForwardMeta | None = field(default=None, init=False, repr=False, compare=False)
    _max_query_len: int | None = field(default=None, init=False, repr=False, compare=False)

    def layer_done(self, layer_idx: int) -> None:
        """The model finished decoder layer `layer_idx` of this step."""
        if self.on_layer is not None:
            self.on_layer(layer_idx)

    @property
    def num_seqs(self) -> int:
        return self.num_decodes + self.num_prefills

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def max_query_len(self) -> int | None:
        """The most tokens any sequence has in this step (from the host lists: no device sync); None
        where the host lists are placeholders (a captured graph serves many batches)."""
        if not self.host_lists:
            return None
        if self._max_query_len is None:
            q = self.query_start_loc_cpu
            self._max_query_len = max((b - a for a, b in zip(q, q[1:], strict=False)), default=0)
        return self._max_query_len

    def prefill_view(self) -> ForwardMeta:
        """The prefill sequences alone, token offsets rebased to start at 0."""
        if self._prefill is None:
            self._prefill = self._make_prefill_view()
        return self._prefill

    def decode_view(self) -> ForwardMeta:
        """The decode sequences alone (one token each)."""
        if self._decode is None:
            self._decode = self._make_decode_view()
        return self._decode

    def _make_prefill_view(self) -> ForwardMeta:
        d = self.num_decodes
        base = self.query_start_loc_cpu[d]
        return ForwardMeta(
            num_decodes=0,
            num_prefills=self.num_prefills,
            num_tokens=self.num_tokens - base,
            query_start_loc=self.query_start_loc[d:] - base,
            context_lens=self.context_lens[d:],
            seq_lens=self.seq_lens[d:],
            state_indices=self.state_indices[d:],
            has_initial_state=self.has_initial_state[d:],
            slot_mapping=self.slot_mapping[base:],
            block_tables=self.block_tables[d:],
            query_start_loc_cpu=[x - base for x in self.query_start_loc_cpu[d:]],
            context_lens_cpu=self.context_lens_cpu[d:],
            seq_lens_cpu=self.seq_lens_cpu[d:],
            host_lists=self.host_lists,
        )

    def _make_decode_view(self) -> ForwardMeta:
        d = self.num_decodes
        return ForwardMeta(
            num_decodes=d,
            num_prefills=0,
            num_tokens=d,
            query_start_loc=self.query_start_loc[: d + 1],
            context_lens=self.context_lens[:d],
            seq_lens=self.seq_lens[:d],
            state_indices=self.state_indices[:d],
            has_initial_state=self.has_initial_state[:d],
            slot_mapping=self.slot_mapping[:d],
            block_tables=self.block_tables[:d],
            query_start_loc_cpu=self.query_start_loc_cpu[: d + 1],
            context_lens_cpu=self.context_lens_cpu[:d],
            seq_lens_cpu=self.seq_lens_cpu[:d],
            host_lists=self.host_lists,
        )
