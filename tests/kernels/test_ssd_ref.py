"""mamba_chunk_scan_varlen_ref against the token-by-token float64 recurrence."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_oracles import INF_LIMIT, SSMInputs, assert_close, cu_of, gen, i32, make_ssm_inputs, naive_ssm
from torch import Tensor

from pd_ssm.kernels.ssd import ScanOutput, mamba_chunk_scan_varlen_ref

H, P, N = 4, 3, 5


def scan(
    inp: SSMInputs, cu: Sequence[int], ctx: Sequence[int], pool: Tensor, slots: Sequence[int],
    has_init: Sequence[bool], chunk_size: int, *, limit: Sequence[float] = INF_LIMIT, boundaries: bool = True,
) -> ScanOutput:
    return mamba_chunk_scan_varlen_ref(
        inp.x, inp.dt, inp.A, inp.B, inp.C, chunk_size,
        cu_seqlens=i32(cu), context_lens=i32(ctx), ssm_state=pool, state_indices=i32(slots),
        has_initial_state=torch.tensor(list(has_init)), D=inp.D, dt_bias=inp.dt_bias,
        dt_limit=limit, return_boundary_states=boundaries,
    )


def check_against_oracle(
    lengths: Sequence[int], ctx: Sequence[int], has_init: Sequence[bool], chunk_size: int, *, G: int,
    seed: int, limit: Sequence[float] = INF_LIMIT, dtype: torch.dtype = torch.float32,
    pool_dtype: torch.dtype = torch.float32, rtol: float = 1e-5, atol: float = 1e-5,
) -> None:
    g = gen(seed)
    S, T = len(lengths), sum(lengths)
    cu = cu_of(lengths)
    inp = make_ssm_inputs(g, T, H, P, G, N, dtype)
    num_slots = S + 3
    pool = torch.randn(num_slots, H, P, N, generator=g).to(pool_dtype)  # random, also the unused slots
    slots = torch.randperm(num_slots, generator=g)[:S].tolist()
    before = pool.clone()

    res = scan(inp, cu, ctx, pool, slots, has_init, chunk_size, limit=limit)

    init = torch.stack([before[i].double() if h else torch.zeros(H, P, N, dtype=torch.float64)
                        for i, h in zip(slots, has_init, strict=True)])
    y, states = naive_ssm(inp, cu, init, limit=limit)
    assert res.out.dtype == dtype and res.out.shape == (T, H, P)
    assert_close(res.out, y, rtol, atol, "out")
    # a bf16 pool rounds the final state once more (half an ulp: 2^-9 relative)
    state_tol = max(rtol, 2**-8) if pool_dtype != torch.float32 else rtol
    for s, i in enumerate(slots):
        assert_close(pool[i], states[cu[s + 1] - 1], state_tol, state_tol, f"final state of sequence {s}")
    unused = sorted(set(range(num_slots)) - set(slots))
    assert torch.equal(pool[unused], before[unused]), "a slot no sequence owns was written"

    assert res.boundary_states is not None and res.boundary_cu is not None
    assert res.boundary_states.dtype == torch.float32 and res.boundary_cu.dtype == torch.int32
    expected_rows: list[int] = []
    bcu = [0]
    for s in range(S):
        for p in range(ctx[s] + 1, ctx[s] + lengths[s] + 1):
            if p % chunk_size == 0:  # the state after token p-1
                expected_rows.append(cu[s] + (p - ctx[s]) - 1)
        bcu.append(len(expected_rows))
    assert res.boundary_cu.tolist() == bcu
    assert_close(res.boundary_states, states[expected_rows], rtol, atol, "boundary states")


@pytest.mark.parametrize("G", [1, 2, 4])
def test_mixed_varlen_batch(G: int) -> None:
    # chunk 8: a single token, shorter than a chunk, exactly a chunk, several chunks, straddling
    # two boundaries from a mid-chunk start, exactly ending on a boundary from a mid-chunk start
    lengths = [1, 5, 8, 27, 11, 5]
    ctx = [0, 0, 0, 0, 6, 3]
    check_against_oracle(lengths, ctx, [False] * 6, 8, G=G, seed=10 + G)


@pytest.mark.parametrize("G", [1, 2])
def test_mid_chunk_starts_with_initial_states(G: int) -> None:
    lengths = [1, 3, 9, 20, 7, 16]
    ctx = [5, 7, 3, 13, 40, 8]
    has_init = [True, True, False, True, True, True]
    check_against_oracle(lengths, ctx, has_init, 8, G=G, seed=20 + G)


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_chunk_sizes(chunk_size: int) -> None:
    check_against_oracle([9, 17, 2], [3, 0, 62], [True, False, True], chunk_size, G=2, seed=30 + chunk_size)


def test_dt_limit_clamp_is_applied() -> None:
    limit = (0.2, 0.6)  # softplus(dt + bias) spans about (0.1, 1.0): both ends clamp
    check_against_oracle([12, 7], [0, 5], [False, True], 4, G=2, seed=40, limit=limit)
    g = gen(41)
    inp = make_ssm_inputs(g, 8, H, P, 2, N)
    pool = torch.randn(2, H, P, N, generator=g)
    clamped = scan(inp, [0, 8], [0], pool.clone(), [0], [True], 4, limit=limit).out
    free = scan(inp, [0, 8], [0], pool.clone(), [0], [True], 4).out
    assert not torch.allclose(clamped, free), "the limit changed nothing: the test does not exercise it"


def test_bf16_inputs_and_pool() -> None:
    # the oracle runs on the same bf16-rounded inputs; the gap is bf16 output rounding (~4e-3 rel)
    check_against_oracle([1, 6, 19], [0, 2, 5], [False, True, True], 8, G=2, seed=50,
                         dtype=torch.bfloat16, pool_dtype=torch.bfloat16, rtol=2e-2, atol=2e-2)


def test_fp32_inputs_bf16_pool() -> None:
    check_against_oracle([5, 10], [1, 4], [True, True], 4, G=1, seed=51, pool_dtype=torch.bfloat16)


def test_no_initial_state_ignores_slot_contents() -> None:
    g = gen(60)
    inp = make_ssm_inputs(g, 10, H, P, 2, N)
    runs = []
    for fill in (torch.randn(3, H, P, N, generator=g), torch.zeros(3, H, P, N)):
        pool = fill.clone()
        runs.append((scan(inp, [0, 4, 10], [0, 7], pool, [2, 0], [False, False], 4), pool))
    (a, pool_a), (b, pool_b) = runs
    assert torch.equal(a.out, b.out)
    assert torch.equal(pool_a[[2, 0]], pool_b[[2, 0]])


def test_split_prefill_equals_one_scan() -> None:
    """Chunked prefill: scanning 0..n in one call == scanning it in pieces that resume mid-chunk."""
    g = gen(70)
    n, cs = 37, 8
    inp = make_ssm_inputs(g, n, H, P, 2, N)
    pool = torch.randn(4, H, P, N, generator=g)
    whole_pool = pool.clone()
    whole = scan(inp, [0, n], [0], whole_pool, [1], [False], cs)

    outs, bstates = [], []
    for a, b in [(0, 5), (5, 16), (16, 17), (17, 37)]:
        part = SSMInputs(inp.x[a:b], inp.dt[a:b], inp.A, inp.B[a:b], inp.C[a:b], inp.D, inp.dt_bias)
        res = scan(part, [0, b - a], [a], pool, [1], [a > 0], cs)
        outs.append(res.out)
        assert res.boundary_states is not None
        bstates.append(res.boundary_states)
    assert_close(torch.cat(outs), whole.out, 1e-5, 1e-5)
    assert_close(pool[1], whole_pool[1], 1e-5, 1e-5)
    assert whole.boundary_states is not None
    assert_close(torch.cat(bstates), whole.boundary_states, 1e-5, 1e-5)  # same absolute positions


def test_boundary_states_off_by_default() -> None:
    g = gen(80)
    inp = make_ssm_inputs(g, 9, H, P, 1, N)
    res = scan(inp, [0, 9], [0], torch.randn(1, H, P, N, generator=g), [0], [True], 4, boundaries=False)
    assert res.boundary_states is None and res.boundary_cu is None


def test_without_D_and_dt_bias() -> None:
    g = gen(90)
    inp = make_ssm_inputs(g, 11, H, P, 2, N)
    pool = torch.randn(2, H, P, N, generator=g)
    init = pool.clone().double()
    res = mamba_chunk_scan_varlen_ref(
        inp.x, inp.dt, inp.A, inp.B, inp.C, 4, cu_seqlens=i32([0, 11]), context_lens=i32([2]),
        ssm_state=pool, state_indices=i32([1]), has_initial_state=torch.tensor([True]),
    )
    y, states = naive_ssm(inp, [0, 11], init[[1]], use_D=False, use_bias=False)
    assert_close(res.out, y, 1e-5, 1e-5)
    assert_close(pool[1], states[-1], 1e-5, 1e-5)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    data=st.data(),
    chunk_size=st.sampled_from([2, 3, 8]),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_batches(lengths: list[int], data: st.DataObject, chunk_size: int, seed: int) -> None:
    ctx = data.draw(st.lists(st.integers(0, 20), min_size=len(lengths), max_size=len(lengths)))
    has_init = data.draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    check_against_oracle(lengths, ctx, has_init, chunk_size, G=2, seed=seed)


def test_rejects_bad_arguments() -> None:
    g = gen(100)
    inp = make_ssm_inputs(g, 6, H, P, 2, N)
    pool = torch.randn(2, H, P, N, generator=g)
    ok = dict(cu=[0, 6], ctx=[0], pool=pool, slots=[0], has_init=[True], chunk_size=4)
    with pytest.raises(ValueError, match="dt must have shape"):
        scan(SSMInputs(inp.x, inp.dt[:, :2], inp.A, inp.B, inp.C, inp.D, inp.dt_bias), **ok)
    with pytest.raises(ValueError, match="A must be one of"):
        scan(SSMInputs(inp.x, inp.dt, inp.A.double(), inp.B, inp.C, inp.D, inp.dt_bias), **ok)
    with pytest.raises(ValueError, match="multiple of ngroups"):
        scan(SSMInputs(inp.x, inp.dt, inp.A, inp.B[:, :1].expand(6, 3, N).contiguous(),
                       inp.C[:, :1].expand(6, 3, N).contiguous(), inp.D, inp.dt_bias), **ok)
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        scan(inp, **{**ok, "cu": [0, 5]})
    with pytest.raises(ValueError, match="ssm_state must have shape"):
        scan(inp, **{**ok, "pool": torch.randn(2, H, P, N + 1, generator=g)})
