"""selective_state_update_ref against the float64 recurrence, HF's decode step, and the chunked scan."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from kernel_oracles import INF_LIMIT, SSMInputs, assert_close, gen, i32, make_ssm_inputs, naive_ssm
from torch import Tensor
from transformers.models.mamba2.modeling_mamba2 import mamba2_selective_state_update

from pd_ssm.kernels.ssd import mamba_chunk_scan_varlen_ref
from pd_ssm.kernels.ssu import selective_state_update_ref

H, P, N = 4, 3, 5


def step(inp: SSMInputs, pool: Tensor, slots: Sequence[int], limit: Sequence[float] = INF_LIMIT) -> Tensor:
    return selective_state_update_ref(
        pool, inp.x, inp.dt, inp.A, inp.B, inp.C, state_indices=i32(slots), D=inp.D,
        dt_bias=inp.dt_bias, dt_limit=limit,
    )


@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("limit", [INF_LIMIT, (0.2, 0.6)])
def test_matches_oracle(G: int, limit: tuple[float, float]) -> None:
    g = gen(G)
    Bt, num_slots = 5, 9
    inp = make_ssm_inputs(g, Bt, H, P, G, N)
    pool = torch.randn(num_slots, H, P, N, generator=g)
    slots = torch.randperm(num_slots, generator=g)[:Bt].tolist()
    before = pool.clone()

    y = step(inp, pool, slots, limit)

    # each row is a one-token sequence
    y_ref, states = naive_ssm(inp, list(range(Bt + 1)), before[slots].double(), limit=limit)
    assert y.dtype == inp.x.dtype and y.shape == (Bt, H, P)
    assert_close(y, y_ref, 1e-5, 1e-5)
    assert_close(pool[slots], states, 1e-5, 1e-5)
    unused = sorted(set(range(num_slots)) - set(slots))
    assert torch.equal(pool[unused], before[unused])


def test_bf16_activations_and_pool() -> None:
    g = gen(10)
    inp = make_ssm_inputs(g, 3, H, P, 2, N, torch.bfloat16)
    pool = torch.randn(4, H, P, N, generator=g).to(torch.bfloat16)
    before = pool.clone()
    y = step(inp, pool, [3, 0, 2])
    y_ref, states = naive_ssm(inp, [0, 1, 2, 3], before[[3, 0, 2]].double())
    assert y.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16
    assert_close(y, y_ref, 1e-2, 1e-2)
    assert_close(pool[[3, 0, 2]], states, 1e-2, 1e-2)
    assert torch.equal(pool[1], before[1])


@pytest.mark.parametrize("G", [1, 2])
def test_matches_hf_decode_step(G: int) -> None:
    """Called the way Mamba2Mixer's cached decode path calls transformers' torch step."""
    g = gen(20 + G)
    Bt = 3
    inp = make_ssm_inputs(g, Bt, H, P, G, N)
    pool = torch.randn(Bt, H, P, N, generator=g)
    hf_state = pool.clone()
    y = step(inp, pool, [0, 1, 2])
    hf_y = mamba2_selective_state_update(
        hf_state, inp.x,
        inp.dt[:, :, None].expand(-1, -1, P), inp.A[:, None, None].expand(-1, P, N), inp.B, inp.C,
        inp.D[:, None].expand(-1, P), dt_bias=inp.dt_bias[:, None].expand(-1, P), dt_softplus=True,
    )
    torch.testing.assert_close(y, hf_y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool, hf_state, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k", [1, 3, 9])
def test_scan_then_steps_equals_one_scan(k: int) -> None:
    """Prefill n-k tokens with the chunked scan, decode k with the step == scan all n tokens."""
    g = gen(30 + k)
    n, cs, G = 21, 8, 2
    limit = (0.05, 0.9)
    inp = make_ssm_inputs(g, n, H, P, G, N)
    init = torch.randn(3, H, P, N, generator=g)
    kwargs = dict(D=inp.D, dt_bias=inp.dt_bias, dt_limit=limit)

    whole_pool = init.clone()
    whole = mamba_chunk_scan_varlen_ref(
        inp.x, inp.dt, inp.A, inp.B, inp.C, cs, cu_seqlens=i32([0, n]), context_lens=i32([0]),
        ssm_state=whole_pool, state_indices=i32([1]), has_initial_state=torch.tensor([True]), **kwargs,
    ).out

    pool = init.clone()
    m = n - k
    outs = [mamba_chunk_scan_varlen_ref(
        inp.x[:m], inp.dt[:m], inp.A, inp.B[:m], inp.C[:m], cs, cu_seqlens=i32([0, m]),
        context_lens=i32([0]), ssm_state=pool, state_indices=i32([1]),
        has_initial_state=torch.tensor([True]), **kwargs,
    ).out]
    for t in range(m, n):
        outs.append(selective_state_update_ref(
            pool, inp.x[t:t + 1], inp.dt[t:t + 1], inp.A, inp.B[t:t + 1], inp.C[t:t + 1],
            state_indices=i32([1]), **kwargs,
        ))
    assert_close(torch.cat(outs), whole, 1e-5, 1e-5)
    assert_close(pool, whole_pool, 1e-5, 1e-5)


def test_rejects_bad_arguments() -> None:
    g = gen(40)
    inp = make_ssm_inputs(g, 2, H, P, 2, N)
    with pytest.raises(ValueError, match="state_indices must be one of"):
        selective_state_update_ref(torch.randn(2, H, P, N, generator=g), inp.x, inp.dt, inp.A, inp.B, inp.C,
                                   state_indices=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="ssm_state must be contiguous"):
        selective_state_update_ref(torch.randn(H, 2, P, N, generator=g).transpose(0, 1), inp.x, inp.dt,
                                   inp.A, inp.B, inp.C, state_indices=i32([0, 1]))
