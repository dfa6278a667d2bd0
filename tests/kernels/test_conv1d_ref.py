"""causal_conv1d_varlen_ref / causal_conv1d_update_ref against a float64 dot-product oracle and HF."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from kernel_oracles import assert_close, cu_of, gen, i32, naive_conv
from torch import Tensor
from transformers.models.mamba2.modeling_mamba2 import causal_conv1d_fn, causal_conv1d_update

from pd_ssm.kernels.conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref

DIM, W = 6, 4


def make_conv(g: torch.Generator, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    return torch.randn(DIM, W, generator=g).to(dtype), torch.randn(DIM, generator=g).to(dtype)


def varlen(
    x: Tensor, weight: Tensor, bias: Tensor | None, pool: Tensor, lengths: Sequence[int],
    slots: Sequence[int], has_init: Sequence[bool], activation: str | None = "silu",
) -> Tensor:
    return causal_conv1d_varlen_ref(
        x, weight, bias, pool, cu_seqlens=i32(cu_of(lengths)), state_indices=i32(slots),
        has_initial_state=torch.tensor(list(has_init)), activation=activation,
    )


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_bias", [True, False])
def test_varlen_matches_oracle(activation: str | None, with_bias: bool) -> None:
    g = gen(1)
    # lengths 1 and 2 are shorter than the W-1 = 3 inputs the state keeps
    lengths = [1, 2, 3, 7, 12, 2]
    has_init = [True, True, False, True, False, False]
    S, T = len(lengths), sum(lengths)
    x = torch.randn(T, DIM, generator=g)
    weight, bias = make_conv(g)
    bias_or_none = bias if with_bias else None
    num_slots = S + 2
    pool = torch.randn(num_slots, DIM, W - 1, generator=g)
    slots = torch.randperm(num_slots, generator=g)[:S].tolist()
    before = pool.clone()

    out = varlen(x, weight, bias_or_none, pool, lengths, slots, has_init, activation)

    assert out.shape == (T, DIM) and out.dtype == x.dtype
    cu = cu_of(lengths)
    for s, (i, h) in enumerate(zip(slots, has_init, strict=True)):
        history = before[i] if h else torch.zeros(DIM, W - 1)
        xs = x[cu[s]:cu[s + 1]]
        expected = naive_conv(history, xs, weight, bias_or_none, silu=activation == "silu")
        assert_close(out[cu[s]:cu[s + 1]], expected, 1e-5, 1e-6, f"sequence {s}")
        # the state is the newest W-1 inputs of history ++ x: old and new mixed when x is short
        assert torch.equal(pool[i], torch.cat([history, xs.T], dim=1)[:, -(W - 1):])
    unused = sorted(set(range(num_slots)) - set(slots))
    assert torch.equal(pool[unused], before[unused])


def test_no_initial_state_ignores_slot_contents() -> None:
    g = gen(2)
    x = torch.randn(5, DIM, generator=g)
    weight, bias = make_conv(g)
    pool_a = torch.randn(2, DIM, W - 1, generator=g)
    pool_b = torch.zeros(2, DIM, W - 1)
    out_a = varlen(x, weight, bias, pool_a, [2, 3], [1, 0], [False, False])
    out_b = varlen(x, weight, bias, pool_b, [2, 3], [1, 0], [False, False])
    assert torch.equal(out_a, out_b)
    assert torch.equal(pool_a, pool_b)


def test_update_matches_oracle() -> None:
    g = gen(3)
    Bt, num_slots = 5, 8
    x = torch.randn(Bt, DIM, generator=g)
    weight, bias = make_conv(g)
    pool = torch.randn(num_slots, DIM, W - 1, generator=g)
    slots = torch.randperm(num_slots, generator=g)[:Bt].tolist()
    before = pool.clone()
    out = causal_conv1d_update_ref(x, pool, weight, bias, state_indices=i32(slots))
    for b, i in enumerate(slots):
        assert_close(out[b], naive_conv(before[i], x[b:b + 1], weight, bias, silu=True)[0], 1e-5, 1e-6)
        assert torch.equal(pool[i], torch.cat([before[i][:, 1:], x[b][:, None]], dim=1))
    unused = sorted(set(range(num_slots)) - set(slots))
    assert torch.equal(pool[unused], before[unused])


@pytest.mark.parametrize("split", [1, 2, 5])
def test_varlen_then_updates_equals_one_varlen(split: int) -> None:
    """Prefill of `split` tokens then decode steps == prefill of all tokens (state and outputs)."""
    g = gen(10 + split)
    n = 8
    x = torch.randn(n, DIM, generator=g)
    weight, bias = make_conv(g)
    init = torch.randn(3, DIM, W - 1, generator=g)
    whole_pool = init.clone()
    whole = varlen(x, weight, bias, whole_pool, [n], [2], [True])

    pool = init.clone()
    outs = [varlen(x[:split], weight, bias, pool, [split], [2], [True])]
    for t in range(split, n):
        outs.append(causal_conv1d_update_ref(x[t:t + 1], pool, weight, bias, state_indices=i32([2])))
    assert_close(torch.cat(outs), whole, 1e-6, 1e-6)
    assert torch.equal(pool, whole_pool)


def test_varlen_split_into_prefill_chunks() -> None:
    g = gen(20)
    x = torch.randn(9, DIM, generator=g)
    weight, bias = make_conv(g)
    whole_pool = torch.randn(1, DIM, W - 1, generator=g)
    pool = whole_pool.clone()
    whole = varlen(x, weight, bias, whole_pool, [9], [0], [False])
    parts = [varlen(x[a:b], weight, bias, pool, [b - a], [0], [a > 0]) for a, b in [(0, 2), (2, 3), (3, 9)]]
    assert_close(torch.cat(parts), whole, 1e-6, 1e-6)
    assert torch.equal(pool, whole_pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf_torch_path(dtype: torch.dtype) -> None:
    """Same ops as transformers' causal_conv1d_fn / causal_conv1d_update.

    The conv is bit-identical; silu may differ by one ulp, because torch's vectorized and scalar
    silu loops round differently and the two paths lay the tensor out differently.
    """
    one_ulp = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7}[dtype]  # relative, at worst
    g = gen(30)
    L = 7
    x = torch.randn(L, DIM, generator=g).to(dtype)
    weight, bias = make_conv(g, dtype)
    pool = torch.randn(1, DIM, W - 1, generator=g).to(dtype)
    for activation in (None, "silu"):
        out = varlen(x, weight, bias, pool.clone(), [L], [0], [False], activation)
        hf = causal_conv1d_fn(x.T[None], weight, bias, activation=activation)[0].T
        if activation is None:
            assert torch.equal(out, hf)
        torch.testing.assert_close(out, hf, rtol=one_ulp, atol=0)

    # HF's decode state keeps W inputs, of which the step uses the newest W-1
    hf_state = torch.cat([torch.randn(1, DIM, 1, generator=g).to(dtype), pool.clone()], dim=-1)
    x1 = torch.randn(1, DIM, generator=g).to(dtype)
    step = causal_conv1d_update_ref(x1, pool, weight, bias, state_indices=i32([0]))
    hf_step = causal_conv1d_update(x1[:, :, None], hf_state, weight, bias, activation="silu")[:, :, 0]
    torch.testing.assert_close(step, hf_step, rtol=one_ulp, atol=0)
    assert torch.equal(pool, hf_state[:, :, 1:])


def test_bf16_pool_dtype_differs_from_input() -> None:
    g = gen(40)
    x = torch.randn(4, DIM, generator=g)
    weight, bias = make_conv(g)
    pool = torch.randn(2, DIM, W - 1, generator=g).to(torch.bfloat16)
    before = pool.clone()
    out = varlen(x, weight, bias, pool, [4], [1], [True])
    expected = naive_conv(before[1].float(), x, weight, bias, silu=True)
    assert_close(out, expected, 1e-5, 1e-6)
    assert torch.equal(pool[1], x[-(W - 1):].T.to(torch.bfloat16))
    assert torch.equal(pool[0], before[0])


def test_rejects_bad_arguments() -> None:
    g = gen(50)
    x = torch.randn(4, DIM, generator=g)
    weight, bias = make_conv(g)
    pool = torch.randn(2, DIM, W - 1, generator=g)
    with pytest.raises(ValueError, match="conv_state must have shape"):
        varlen(x, weight, bias, torch.randn(2, DIM, W, generator=g), [4], [0], [True])
    with pytest.raises(ValueError, match="weight must be one of"):
        varlen(x, weight.double(), bias, pool, [4], [0], [True])
    with pytest.raises(ValueError, match="activation"):
        varlen(x, weight, bias, pool, [4], [0], [True], activation="gelu")
    with pytest.raises(ValueError, match="stride 1"):
        causal_conv1d_update_ref(x.T.contiguous().T, torch.randn(4, DIM, W - 1, generator=g), weight, bias,
                                 state_indices=i32([0, 1, 2, 3]))
