"""Triton paged KV cache write, decode attention and varlen prefill attention against the references.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET), on tiny
shapes; with CUDA the same checks run at hybrid-model sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from kernel_oracles import cu_of, gen, i32
from torch import Tensor

from pd_ssm.kernels import attention_decode_triton
from pd_ssm.kernels.attention import (
    paged_decode_attention_ref,
    varlen_prefill_attention_ref,
    write_kv_cache_ref,
)
from pd_ssm.kernels.attention_decode_triton import DecodeConfig, launch_decode, paged_decode_attention_triton
from pd_ssm.kernels.attention_prefill_triton import (
    PrefillConfig,
    launch_prefill,
    varlen_prefill_attention_triton,
)
from pd_ssm.kernels.kv_write_triton import write_kv_cache_triton

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BLOCK = 16 if CUDA else 4  # tokens per cache block
HEAD_DIM = 128 if CUDA else 16
# fp32: scores and P.V in fp32 like the reference. bf16 prefill rounds P to bf16 for the tensor-core
# product (about one ulp of the bf16 output)
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)}


def caches(
    g: torch.Generator, num_blocks: int, hkv: int, dtype: torch.dtype, d: int = HEAD_DIM
) -> tuple[Tensor, Tensor]:
    shape = (num_blocks, BLOCK, hkv, d)
    k = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    return k, torch.randn(*shape, generator=g).to(dtype).to(DEV)


def block_tables(g: torch.Generator, num_seqs: int, max_blocks: int, num_blocks: int) -> Tensor:
    """Distinct random blocks for every sequence; entries past a sequence's end are random too."""
    perm = torch.randperm(num_blocks, generator=g)[: num_seqs * max_blocks]
    return perm.view(num_seqs, max_blocks).to(torch.int32).to(DEV)


@pytest.mark.parametrize("src_dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_write_kv_cache_matches_ref(src_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    g = gen(1)
    T, hkv = 9, 3
    kc, vc = caches(g, 6, hkv, cache_dtype)
    proj = torch.randn(T, 2 * hkv * HEAD_DIM + 5, generator=g).to(src_dtype).to(DEV)
    k = proj[:, :hkv * HEAD_DIM].view(T, hkv, HEAD_DIM)  # views with a row stride of the projection
    v = proj[:, hkv * HEAD_DIM + 5:].view(T, hkv, HEAD_DIM)
    slots = torch.randperm(6 * BLOCK, generator=g)[:T]
    slots[[2, 7]] = -1  # padding tokens
    slot_mapping = slots.to(DEV)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache_triton(k, v, kc, vc, slot_mapping)
    write_kv_cache_ref(k, v, kc_ref, vc_ref, slot_mapping)
    if CUDA or src_dtype == cache_dtype:
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    else:  # Triton 3.6's interpreter truncates fp32 -> bf16 instead of rounding to nearest
        torch.testing.assert_close(kc, kc_ref, rtol=2.0**-7, atol=0)
        torch.testing.assert_close(vc, vc_ref, rtol=2.0**-7, atol=0)


def run_decode(fn, q, kc, vc, seq_lens, tables, scale):  # type: ignore[no-untyped-def]
    return fn(q, kc, vc, seq_lens=i32(seq_lens).to(DEV), block_tables=tables, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (3, 1)])
@pytest.mark.parametrize("splits", ["auto", "many"])
def test_decode_matches_ref(dtype: torch.dtype, heads: int, kv_heads: int, splits: str,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    if splits == "many":  # as if the GPU had many SMs: every (sequence, kv head) split 16 ways or more
        monkeypatch.setattr(attention_decode_triton, "num_sms", lambda device: 4096)
    g = gen(2)
    max_blocks = 10 if not CUDA else 40
    seq_lens = [1, 3, BLOCK, 2 * BLOCK + 1, max_blocks * BLOCK, 17]
    B = len(seq_lens)
    kc, vc = caches(g, B * max_blocks + 3, kv_heads, dtype)
    tables = block_tables(g, B, max_blocks, B * max_blocks + 3)
    q = torch.randn(B, heads, HEAD_DIM, generator=g).to(dtype).to(DEV)
    scale = HEAD_DIM**-0.5
    out = run_decode(paged_decode_attention_triton, q, kc, vc, seq_lens, tables, scale)
    ref = run_decode(paged_decode_attention_ref, q, kc, vc, seq_lens, tables, scale)
    assert out.dtype == dtype and out.shape == (B, heads, HEAD_DIM)
    rtol, atol = (2e-5, 2e-5) if dtype == torch.float32 else (2.0**-7, 1e-3)  # decode P.V is fp32
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("cfg", [DecodeConfig(use_dot=False, block_n=16, num_warps=4),
                                 DecodeConfig(use_dot=True, block_n=32, num_warps=4)])
def test_decode_bf16_tensor_core_and_fma_paths_agree(cfg: DecodeConfig) -> None:
    g = gen(7)
    heads, kv_heads, max_blocks = 8, 2, 12
    kc, vc = caches(g, 2 * max_blocks, kv_heads, torch.bfloat16)
    tables = block_tables(g, 2, max_blocks, 2 * max_blocks)
    q = torch.randn(2, heads, HEAD_DIM, generator=g).to(torch.bfloat16).to(DEV)
    lens = i32([max_blocks * BLOCK, 7]).to(DEV)
    out = launch_decode(q, kc, vc, lens, tables, 0.2, cfg)
    ref = paged_decode_attention_ref(q, kc, vc, seq_lens=lens, block_tables=tables, scale=0.2)
    torch.testing.assert_close(out, ref, rtol=2.0**-7, atol=1e-3)


def test_decode_head_dim_not_a_power_of_two() -> None:
    g = gen(3)
    d = 24
    kc, vc = caches(g, 8, 2, torch.float32, d)
    tables = block_tables(g, 2, 4, 8)
    q = torch.randn(2, 4, d, generator=g).to(DEV)
    out = run_decode(paged_decode_attention_triton, q, kc, vc, [5, 4 * BLOCK], tables, 0.3)
    ref = run_decode(paged_decode_attention_ref, q, kc, vc, [5, 4 * BLOCK], tables, 0.3)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


def run_prefill(  # type: ignore[no-untyped-def]
    fn, q, kc, vc, q_lens: Sequence[int], seq_lens: Sequence[int], tables, scale
):
    return fn(q, kc, vc, cu_seqlens_q=i32(cu_of(q_lens)).to(DEV), seq_lens=i32(seq_lens).to(DEV),
              block_tables=tables, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
def test_prefill_with_context_matches_ref(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    """Chunks of 1, a few and many tokens, with and without earlier chunks' context in the cache."""
    g = gen(4)
    if CUDA:
        q_lens, contexts, max_blocks = [1, 70, 300, 5, 64], [0, 33, 200, 0, 64], 40
    else:
        q_lens, contexts, max_blocks = [1, 7, 70, 3], [0, 5, 2, 9], 20
    seq_lens = [c + n for c, n in zip(contexts, q_lens, strict=True)]
    S, T = len(q_lens), sum(q_lens)
    num_blocks = S * max_blocks + 2
    kc, vc = caches(g, num_blocks, kv_heads, dtype)
    tables = block_tables(g, S, max_blocks, num_blocks)
    q = torch.randn(T, heads, HEAD_DIM, generator=g).to(dtype).to(DEV)
    scale = HEAD_DIM**-0.5
    out = run_prefill(varlen_prefill_attention_triton, q, kc, vc, q_lens, seq_lens, tables, scale)
    ref = run_prefill(varlen_prefill_attention_ref, q, kc, vc, q_lens, seq_lens, tables, scale)
    assert out.dtype == dtype and out.shape == (T, heads, HEAD_DIM)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


# tiles the GPU sweep tried (benchmarks/attention_prefill_gpu.py; fp32 holds its tiles in registers:
# only small ones fit); on CPU small ones, so that query tiles sit past whole key
# tiles of context (the loop's unmasked part) and straddle them
PREFILL_TILES = ([(torch.bfloat16, PrefillConfig(True, 64, 64, 4, 2)),
                  (torch.bfloat16, PrefillConfig(True, 128, 128, 8, 2)),
                  (torch.bfloat16, PrefillConfig(True, 256, 64, 8, 2)),
                  (torch.float32, PrefillConfig(False, 32, 32, 8, 2))] if CUDA
                 else [(dtype, PrefillConfig(dtype == torch.bfloat16, m, n, 4, 2))
                       for dtype in (torch.float32, torch.bfloat16) for m, n in ((16, 8), (8, 16))])


@pytest.mark.parametrize("dtype,cfg", PREFILL_TILES)
def test_prefill_tiles_past_and_across_the_diagonal(dtype: torch.dtype, cfg: PrefillConfig) -> None:
    """Long contexts before short and long chunks: key tiles every query of a tile sees (no masks),
    then the diagonal; query tiles of one token, of a partial tile, and many."""
    g = gen(6)
    if CUDA:
        q_lens, contexts, max_blocks = [1, 300, 70, 129], [0, 200, 513, 64], 40
    else:
        q_lens, contexts, max_blocks = [1, 37, 9, 20], [0, 50, 3, 64], 24
    seq_lens = [c + n for c, n in zip(contexts, q_lens, strict=True)]
    S, T, heads, kv_heads = len(q_lens), sum(q_lens), 4, 2
    num_blocks = S * max_blocks + 2
    kc, vc = caches(g, num_blocks, kv_heads, dtype)
    tables = block_tables(g, S, max_blocks, num_blocks)
    q = torch.randn(T, heads, HEAD_DIM, generator=g).to(dtype).to(DEV)
    scale = HEAD_DIM**-0.5
    out = launch_prefill(q, kc, vc, i32(cu_of(q_lens)).to(DEV), i32(seq_lens).to(DEV), tables, scale, cfg)
    ref = run_prefill(varlen_prefill_attention_ref, q, kc, vc, q_lens, seq_lens, tables, scale)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def test_prefill_then_decode_after_cache_writes() -> None:
    """The attention layer's order: write this step's K/V, then attend (prefill chunk, decode step)."""
    g = gen(5)
    heads, kv_heads, n = 4, 2, 11
    kc, vc = caches(g, 8, kv_heads, torch.float32)
    tables = block_tables(g, 1, 8, 8)
    k = torch.randn(n + 1, kv_heads, HEAD_DIM, generator=g).to(DEV)
    v = torch.randn(n + 1, kv_heads, HEAD_DIM, generator=g).to(DEV)
    q = torch.randn(n + 1, heads, HEAD_DIM, generator=g).to(DEV)
    pos = torch.arange(n + 1)
    slots = (tables[0].long().cpu()[pos // BLOCK] * BLOCK + pos % BLOCK).to(DEV)
    write_kv_cache_triton(k[:n], v[:n], kc, vc, slots[:n])
    pre = run_prefill(varlen_prefill_attention_triton, q[:n], kc, vc, [n], [n], tables, 0.25)
    write_kv_cache_triton(k[n:], v[n:], kc, vc, slots[n:])
    dec = run_decode(paged_decode_attention_triton, q[n:], kc, vc, [n + 1], tables, 0.25)
    # the same attention, by the reference, over all n + 1 tokens as one chunk
    whole = run_prefill(varlen_prefill_attention_ref, q, kc, vc, [n + 1], [n + 1], tables, 0.25)
    torch.testing.assert_close(torch.cat([pre, dec]), whole, rtol=2e-5, atol=2e-5)


def test_rejects_bad_arguments_like_the_ref() -> None:
    g = gen(6)
    kc, vc = caches(g, 4, 2, torch.float32)
    tables = block_tables(g, 1, 4, 4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        q3 = torch.randn(1, 3, HEAD_DIM).to(DEV)
        run_decode(paged_decode_attention_triton, q3, kc, vc, [2], tables, 1.0)
    with pytest.raises(ValueError, match="slot_mapping must be one of"):
        kv = torch.randn(1, 2, HEAD_DIM).to(DEV)
        write_kv_cache_triton(kv, kv, kc, vc, i32([0]).to(DEV))
