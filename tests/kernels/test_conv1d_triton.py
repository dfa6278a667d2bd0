"""Triton causal conv1d (varlen and update) against the pure-torch references.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET), on tiny
shapes; with CUDA the same checks run at sizes that span several tiles.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from kernel_oracles import cu_of, gen, i32
from torch import Tensor

from pd_ssm.kernels.conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from pd_ssm.kernels.conv1d_triton import causal_conv1d_update_triton, causal_conv1d_varlen_triton

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# dim not a multiple of the channel tile, so the masks are exercised
DIM = 300 if CUDA else 40
# NOTE: one rounding of the conv and one of silu in x.dtype; sum orders differ from F.conv1d's
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def assert_pool_equal(pool: Tensor, expected: Tensor, x_dtype: torch.dtype) -> None:
    """The state is data movement and casts only: bit-exact on the GPU. Triton 3.6's interpreter
    truncates fp32 -> bf16 instead of rounding to nearest, so there history that went through bf16
    (a bf16 pool or bf16 inputs) may be one bf16 ulp off."""
    if CUDA or torch.bfloat16 not in (pool.dtype, x_dtype):
        assert torch.equal(pool, expected)
    else:
        torch.testing.assert_close(pool, expected, rtol=2.0**-7, atol=0)


def conv_params(g: torch.Generator, width: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    weight = torch.randn(DIM, width, generator=g).to(dtype).to(DEV)
    bias = torch.randn(DIM, generator=g).to(dtype).to(DEV)
    return weight, bias


def run_varlen(  # type: ignore[no-untyped-def]
    fn, x, weight, bias, pool, lengths, slots, has_init, activation
):
    return fn(
        x, weight, bias, pool, cu_seqlens=i32(cu_of(lengths)).to(DEV), state_indices=i32(slots).to(DEV),
        has_initial_state=torch.tensor(list(has_init), device=DEV), activation=activation,
    )


def check_varlen(
    seed: int, lengths: Sequence[int], has_init: Sequence[bool], width: int, x_dtype: torch.dtype,
    pool_dtype: torch.dtype, with_bias: bool = True, activation: str | None = "silu",
) -> None:
    g = gen(seed)
    S, T = len(lengths), sum(lengths)
    x = torch.randn(T, DIM, generator=g).to(x_dtype).to(DEV)
    weight, bias = conv_params(g, width, x_dtype)
    num_slots = S + 3
    pool = torch.randn(num_slots, DIM, width - 1, generator=g).to(pool_dtype).to(DEV)
    slots = torch.randperm(num_slots, generator=g)[:S].tolist()
    pool_ref = pool.clone()
    b = bias if with_bias else None

    out = run_varlen(causal_conv1d_varlen_triton, x, weight, b, pool, lengths, slots, has_init, activation)
    ref = run_varlen(causal_conv1d_varlen_ref, x, weight, b, pool_ref, lengths, slots, has_init, activation)

    assert out.dtype == x_dtype and out.shape == (T, DIM)
    rtol, atol = TOL[x_dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    assert_pool_equal(pool, pool_ref, x_dtype)  # unused slots untouched too


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [4, 2])
def test_varlen_matches_ref(x_dtype: torch.dtype, width: int) -> None:
    # lengths 1 and 2 are shorter than width-1 = 3: old history and new inputs mix in the state
    lengths = [1, 2, 3, 19, 1, 5] if not CUDA else [1, 2, 3, 700, 1, 37, 130]
    has_init = [True, True, False, True, False, True, False][: len(lengths)]
    check_varlen(1, lengths, has_init, width, x_dtype, x_dtype)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_varlen_fp32_pool_bf16_input_no_bias(activation: str | None) -> None:
    # history is rounded to bf16 on the way in; a short sequence writes it back rounded
    check_varlen(2, [2, 1, 9], [True, True, True], 4, torch.bfloat16, torch.float32, False, activation)


def test_varlen_single_long_sequence_spans_tiles() -> None:
    check_varlen(3, [40 if not CUDA else 3000], [True], 4, torch.float32, torch.float32)


def test_varlen_reads_every_history_before_writing() -> None:
    """Two chunks of one prompt in a row through the pool equal one call on the whole prompt."""
    g = gen(4)
    n, width = 9, 4
    x = torch.randn(n, DIM, generator=g).to(DEV)
    weight, bias = conv_params(g, width, torch.float32)
    pool = torch.randn(2, DIM, width - 1, generator=g).to(DEV)
    whole_pool = pool.clone()
    whole = run_varlen(causal_conv1d_varlen_triton, x, weight, bias, whole_pool, [n], [1], [True], "silu")
    parts = [run_varlen(causal_conv1d_varlen_triton, x[a:b], weight, bias, pool, [b - a], [1], [True], "silu")
             for a, b in [(0, 1), (1, 3), (3, n)]]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool, whole_pool)


@pytest.mark.parametrize("x_dtype,pool_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_update_matches_ref(x_dtype: torch.dtype, pool_dtype: torch.dtype, with_bias: bool) -> None:
    g = gen(5)
    Bt, num_slots, width = (5, 8, 4) if not CUDA else (67, 100, 4)
    x = torch.randn(Bt, DIM, generator=g).to(x_dtype).to(DEV)
    weight, bias = conv_params(g, width, x_dtype)
    pool = torch.randn(num_slots, DIM, width - 1, generator=g).to(pool_dtype).to(DEV)
    slots = i32(torch.randperm(num_slots, generator=g)[:Bt].tolist()).to(DEV)
    pool_ref = pool.clone()
    b = bias if with_bias else None
    out = causal_conv1d_update_triton(x, pool, weight, b, state_indices=slots)
    ref = causal_conv1d_update_ref(x, pool_ref, weight, b, state_indices=slots)
    rtol, atol = TOL[x_dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    assert_pool_equal(pool, pool_ref, x_dtype)


def test_update_strided_input_and_padding_slot() -> None:
    """x as a column slice of a wider projection; a negative slot touches nothing and gives zeros."""
    g = gen(6)
    width = 3
    proj = torch.randn(4, DIM + 7, generator=g).to(DEV)
    x = proj[:, 7:]  # stride(0) = DIM + 7
    weight, bias = conv_params(g, width, torch.float32)
    pool = torch.randn(6, DIM, width - 1, generator=g).to(DEV)
    before = pool.clone()
    out = causal_conv1d_update_triton(x, pool, weight, bias, state_indices=i32([4, -1, 0, 2]).to(DEV))
    keep = [0, 2, 3]
    ref_pool = before.clone()
    ref = causal_conv1d_update_ref(x[keep], ref_pool, weight, bias, state_indices=i32([4, 0, 2]).to(DEV))
    torch.testing.assert_close(out[keep], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(pool, ref_pool)


def test_varlen_then_updates_equals_one_varlen() -> None:
    g = gen(7)
    n, split, width = 7, 2, 4
    x = torch.randn(n, DIM, generator=g).to(DEV)
    weight, bias = conv_params(g, width, torch.float32)
    init = torch.randn(3, DIM, width - 1, generator=g).to(DEV)
    whole_pool = init.clone()
    whole = run_varlen(causal_conv1d_varlen_triton, x, weight, bias, whole_pool, [n], [2], [True], "silu")
    pool = init.clone()
    outs = [run_varlen(causal_conv1d_varlen_triton, x[:split], weight, bias, pool, [split], [2], [True],
                       "silu")]
    slot = i32([2]).to(DEV)
    for t in range(split, n):
        outs.append(causal_conv1d_update_triton(x[t:t + 1], pool, weight, bias, state_indices=slot))
    torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool, whole_pool)


def test_rejects_bad_arguments_like_the_ref() -> None:
    g = gen(8)
    x = torch.randn(4, DIM, generator=g)
    weight, bias = conv_params(g, 4, torch.float32)
    pool = torch.randn(2, DIM, 3, generator=g)
    with pytest.raises(ValueError, match="conv_state must have shape"):
        run_varlen(causal_conv1d_varlen_triton, x, weight.cpu(), bias.cpu(), torch.randn(2, DIM, 4), [4], [0],
                   [True], "silu")
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_update_triton(x[:1], pool, weight.cpu(), bias.cpu(), state_indices=i32([0]),
                                    activation="gelu")


def test_varlen_empty_sequences_touch_nothing() -> None:
    """CUDA-graph padding: zero-length sequences (repeated offsets) anywhere in the batch, pointing
    at a negative slot or at a live sequence's slot, change no output and no slot."""
    g = gen(9)
    width, real = 4, [3, 1, 20 if not CUDA else 300, 2]
    x = torch.randn(sum(real), DIM, generator=g).to(DEV)
    weight, bias = conv_params(g, width, torch.float32)
    pool = torch.randn(8, DIM, width - 1, generator=g).to(DEV)
    pool_ref = pool.clone()
    slots, init = [5, 2, 0, 7], [True, False, True, True]
    ref = run_varlen(causal_conv1d_varlen_ref, x, weight, bias, pool_ref, real, slots, init, "silu")
    # empties first, between and last; their slots: -1, a live one (0), a free one (3)
    lengths = [0, 3, 0, 0, 1, 20 if not CUDA else 300, 0, 2, 0]
    padded_slots = [-1, 5, 0, 3, 2, 0, -1, 7, 0]
    padded_init = [True, True, True, False, False, True, True, True, True]
    out = run_varlen(causal_conv1d_varlen_triton, x, weight, bias, pool, lengths, padded_slots, padded_init,
                     "silu")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool, pool_ref)


def test_varlen_all_sequences_empty() -> None:
    g = gen(10)
    weight, bias = conv_params(g, 4, torch.float32)
    pool = torch.randn(3, DIM, 3, generator=g).to(DEV)
    before = pool.clone()
    x = torch.randn(0, DIM, generator=g).to(DEV)
    out = run_varlen(causal_conv1d_varlen_triton, x, weight, bias, pool, [0, 0], [0, 1], [True, False], "silu")
    assert out.shape == (0, DIM)
    assert torch.equal(pool, before)


def test_varlen_negative_slot_is_history_free_padding() -> None:
    """A sequence with a negative slot: zeros as history (has_initial_state ignored), no write."""
    g = gen(11)
    width, lengths = 4, [5, 2]
    x = torch.randn(sum(lengths), DIM, generator=g).to(DEV)
    weight, bias = conv_params(g, width, torch.float32)
    pool = torch.randn(4, DIM, width - 1, generator=g).to(DEV)
    before, pool_ref = pool.clone(), pool.clone()
    out = run_varlen(causal_conv1d_varlen_triton, x, weight, bias, pool, lengths, [-1, 1], [True, True], "silu")
    ref = run_varlen(causal_conv1d_varlen_ref, x, weight, bias, pool_ref, lengths, [0, 1], [False, True], "silu")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[0], before[0])  # the reference wrote its stand-in slot 0
    assert torch.equal(pool[1:], pool_ref[1:])


@pytest.mark.parametrize("width", [3, 5])
def test_varlen_strided_input_other_widths(width: int) -> None:
    """x as a column slice of the in_proj output (row stride > dim), widths the model does not use."""
    g = gen(12)
    lengths = [1, 2, 6, 17] if not CUDA else [1, 2, 6, 517]
    proj = torch.randn(sum(lengths), DIM + 9, generator=g).to(torch.bfloat16).to(DEV)
    x = proj[:, 5:5 + DIM]  # stride(0) = DIM + 9
    weight, bias = conv_params(g, width, torch.bfloat16)
    pool = torch.randn(6, DIM, width - 1, generator=g).to(DEV)
    pool_ref = pool.clone()
    init = [True, False, True, True]
    out = run_varlen(causal_conv1d_varlen_triton, x, weight, bias, pool, lengths, [4, 0, 2, 5], init, "silu")
    ref = run_varlen(causal_conv1d_varlen_ref, x, weight, bias, pool_ref, lengths, [4, 0, 2, 5], init, "silu")
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert_pool_equal(pool, pool_ref, torch.bfloat16)


@pytest.mark.parametrize("width", [2, 5])
def test_update_other_widths_even_channel_block(width: int) -> None:
    """Width 2 (no shifted column) and 5; dim a multiple of the channel block (no channel mask)."""
    g = gen(13)
    dim = 64 if not CUDA else 1024
    x = torch.randn(3, dim, generator=g).to(DEV)
    weight = torch.randn(dim, width, generator=g).to(DEV)
    pool = torch.randn(5, dim, width - 1, generator=g).to(DEV)
    pool_ref = pool.clone()
    slots = i32([3, 0, 4]).to(DEV)
    out = causal_conv1d_update_triton(x, pool, weight, None, state_indices=slots, activation=None)
    ref = causal_conv1d_update_ref(x, pool_ref, weight, None, state_indices=slots, activation=None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool, pool_ref)
