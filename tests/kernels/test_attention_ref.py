"""Paged KV write and attention references against full causal attention in float64."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from kernel_oracles import assert_close, cu_of, gen, i32, naive_causal_attention
from torch import Tensor

from pd_ssm.kernels.attention import (
    paged_decode_attention_ref,
    varlen_prefill_attention_ref,
    write_kv_cache_ref,
)

BLOCK, NUM_BLOCKS, HEAD_DIM = 4, 24, 8


class PagedSeqs:
    """Sequences whose K/V live in randomly chosen, non-contiguous blocks of random pools."""

    def __init__(self, g: torch.Generator, lengths: Sequence[int], H: int, Hkv: int, dtype: torch.dtype):
        self.lengths = list(lengths)
        self.q = [torch.randn(n, H, HEAD_DIM, generator=g).to(dtype) for n in lengths]
        self.k = [torch.randn(n, Hkv, HEAD_DIM, generator=g).to(dtype) for n in lengths]
        self.v = [torch.randn(n, Hkv, HEAD_DIM, generator=g).to(dtype) for n in lengths]
        # random pool contents: reading an unwritten or masked entry would show
        self.k_cache = torch.randn(NUM_BLOCKS, BLOCK, Hkv, HEAD_DIM, generator=g).to(dtype)
        self.v_cache = torch.randn(NUM_BLOCKS, BLOCK, Hkv, HEAD_DIM, generator=g).to(dtype)
        blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        max_blocks = max(-(-n // BLOCK) for n in lengths) + 1  # one spare column of padding
        self.block_tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
        for s, n in enumerate(lengths):
            need = -(-n // BLOCK)
            self.block_tables[s, :need] = torch.tensor(blocks[:need], dtype=torch.int32)
            blocks = blocks[need:]

    def slots(self, s: int, a: int, b: int) -> Tensor:
        pos = torch.arange(a, b)
        return (self.block_tables[s].long()[pos // BLOCK] * BLOCK + pos % BLOCK)  # [b-a] int64

    def write(self, s: int, a: int, b: int) -> None:
        write_kv_cache_ref(self.k[s][a:b], self.v[s][a:b], self.k_cache, self.v_cache, self.slots(s, a, b))

    def oracle(self, s: int, scale: float) -> Tensor:
        return naive_causal_attention(self.q[s], self.k[s], self.v[s], scale)


def test_write_kv_cache_skips_negative_slots() -> None:
    g = gen(1)
    Tn, Hkv = 10, 2
    k = torch.randn(Tn, Hkv, HEAD_DIM, generator=g)
    v = torch.randn(Tn, Hkv, HEAD_DIM, generator=g)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, Hkv, HEAD_DIM, generator=g)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, Hkv, HEAD_DIM, generator=g)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=g)[:Tn]
    slots[[1, 4, 9]] = -1
    write_kv_cache_ref(k, v, k_cache, v_cache, slots)

    written = slots >= 0
    flat_k, flat_v = k_cache.view(-1, Hkv, HEAD_DIM), v_cache.view(-1, Hkv, HEAD_DIM)
    assert torch.equal(flat_k[slots[written]], k[written])
    assert torch.equal(flat_v[slots[written]], v[written])
    untouched = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    untouched[slots[written]] = False
    assert torch.equal(flat_k[untouched], k_before.view(-1, Hkv, HEAD_DIM)[untouched])
    assert torch.equal(flat_v[untouched], v_before.view(-1, Hkv, HEAD_DIM)[untouched])


@pytest.mark.parametrize(("H", "Hkv"), [(4, 4), (4, 2), (6, 1)])
def test_chunked_prefill_equals_full_causal_attention(H: int, Hkv: int) -> None:
    """Each round writes one chunk per sequence, then attends over everything so far."""
    g = gen(10 + H + Hkv)
    scale = HEAD_DIM**-0.5
    seqs = PagedSeqs(g, [1, 9, 14, 5], H, Hkv, torch.float32)
    # chunk boundaries per sequence (a chunk may start mid-block); rounds run the i-th chunk of each
    splits = [[0, 1], [0, 3, 4, 9], [0, 5, 13, 14], [0, 5]]
    outs: list[list[Tensor]] = [[] for _ in splits]
    for r in range(max(len(b) - 1 for b in splits)):
        batch = [s for s, b in enumerate(splits) if r < len(b) - 1]
        spans = [(splits[s][r], splits[s][r + 1]) for s in batch]
        for s, (a, b) in zip(batch, spans, strict=True):
            seqs.write(s, a, b)
        out = varlen_prefill_attention_ref(
            torch.cat([seqs.q[s][a:b] for s, (a, b) in zip(batch, spans, strict=True)]), seqs.k_cache, seqs.v_cache,
            cu_seqlens_q=i32(cu_of([b - a for a, b in spans])), seq_lens=i32([b for _, b in spans]),
            block_tables=seqs.block_tables[batch], scale=scale,
        )
        cu = cu_of([b - a for a, b in spans])
        for j, s in enumerate(batch):
            outs[s].append(out[cu[j]:cu[j + 1]])
    for s in range(len(splits)):
        assert_close(torch.cat(outs[s]), seqs.oracle(s, scale), 1e-5, 1e-6, f"sequence {s}")


@pytest.mark.parametrize(("H", "Hkv"), [(4, 4), (4, 2)])
def test_decode_equals_last_row(H: int, Hkv: int) -> None:
    g = gen(20 + Hkv)
    scale = 0.3
    lengths = [1, 4, 5, 11]
    seqs = PagedSeqs(g, lengths, H, Hkv, torch.float32)
    for s, n in enumerate(lengths):
        seqs.write(s, 0, n)
    out = paged_decode_attention_ref(
        torch.stack([q[-1] for q in seqs.q]), seqs.k_cache, seqs.v_cache,
        seq_lens=i32(lengths), block_tables=seqs.block_tables, scale=scale,
    )
    assert out.shape == (len(lengths), H, HEAD_DIM)
    prefill_last = varlen_prefill_attention_ref(
        torch.cat([q[-1:] for q in seqs.q]), seqs.k_cache, seqs.v_cache, cu_seqlens_q=i32(cu_of([1] * 4)),
        seq_lens=i32(lengths), block_tables=seqs.block_tables, scale=scale,
    )
    for s in range(len(lengths)):
        assert_close(out[s], seqs.oracle(s, scale)[-1], 1e-5, 1e-6, f"sequence {s}")
    assert_close(out, prefill_last, 1e-6, 1e-6)


def test_bf16() -> None:
    g = gen(30)
    scale = HEAD_DIM**-0.5
    lengths = [3, 10]
    seqs = PagedSeqs(g, lengths, 4, 2, torch.bfloat16)
    for s, n in enumerate(lengths):
        seqs.write(s, 0, n)
    out = varlen_prefill_attention_ref(
        torch.cat(seqs.q), seqs.k_cache, seqs.v_cache, cu_seqlens_q=i32(cu_of(lengths)),
        seq_lens=i32(lengths), block_tables=seqs.block_tables, scale=scale,
    )
    assert out.dtype == torch.bfloat16
    assert_close(out, torch.cat([seqs.oracle(s, scale) for s in range(2)]), 1e-2, 1e-2)
    dec = paged_decode_attention_ref(
        torch.stack([q[-1] for q in seqs.q]), seqs.k_cache, seqs.v_cache,
        seq_lens=i32(lengths), block_tables=seqs.block_tables, scale=scale,
    )
    assert dec.dtype == torch.bfloat16
    assert_close(dec, torch.stack([seqs.oracle(s, scale)[-1] for s in range(2)]), 1e-2, 1e-2)


def test_rejects_bad_arguments() -> None:
    g = gen(40)
    seqs = PagedSeqs(g, [5], 4, 2, torch.float32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention_ref(torch.randn(1, 3, HEAD_DIM, generator=g), seqs.k_cache, seqs.v_cache,
                                   seq_lens=i32([5]), block_tables=seqs.block_tables, scale=1.0)
    with pytest.raises(ValueError, match="must cover"):
        varlen_prefill_attention_ref(seqs.q[0], seqs.k_cache, seqs.v_cache, cu_seqlens_q=i32([0, 5]),
                                     seq_lens=i32([4]), block_tables=seqs.block_tables, scale=1.0)
    with pytest.raises(ValueError, match="slot_mapping must be one of"):
        write_kv_cache_ref(seqs.k[0], seqs.v[0], seqs.k_cache, seqs.v_cache, i32(range(5)))
