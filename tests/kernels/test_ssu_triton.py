"""Triton selective state update against `selective_state_update_ref` (and the float64 recurrence).

On CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET), on tiny
shapes; with CUDA the same checks run at Mamba2-like sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from kernel_oracles import INF_LIMIT, SSMInputs, gen, i32, make_ssm_inputs, naive_ssm
from torch import Tensor

from pd_ssm.kernels.ssu import selective_state_update_ref
from pd_ssm.kernels.ssu_triton import SSUConfig, launch_ssu, selective_state_update_triton

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# headdim not a power of two and dstate not one either: the tile masks are exercised
H, P, N = (8, 24, 40) if CUDA else (4, 6, 12)


def to_dev(inp: SSMInputs) -> SSMInputs:
    return SSMInputs(**{k: v.to(DEV) for k, v in vars(inp).items()})


def call(  # type: ignore[no-untyped-def]
    fn, inp: SSMInputs, pool: Tensor, slots: Sequence[int], *, use_D: bool = True, use_bias: bool = True,
    softplus: bool = True, limit: Sequence[float] = INF_LIMIT,
) -> Tensor:
    return fn(pool, inp.x, inp.dt, inp.A, inp.B, inp.C, state_indices=i32(slots).to(DEV),
              D=inp.D if use_D else None, dt_bias=inp.dt_bias if use_bias else None,
              dt_softplus=softplus, dt_limit=limit)


def assert_pool_close(pool: Tensor, expected: Tensor) -> None:
    """fp32: a few ulp (fma contraction, exp). bf16: the GPU rounds to nearest like torch; Triton
    3.6's interpreter truncates fp32 -> bf16, so there one ulp is allowed."""
    if pool.dtype == torch.float32:
        torch.testing.assert_close(pool, expected, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(pool, expected, rtol=0 if CUDA else 2.0**-7, atol=0 if CUDA else 1e-30)


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("limit", [INF_LIMIT, (0.2, 0.6)])
def test_fp32_matches_ref(G: int, limit: tuple[float, float]) -> None:
    g = gen(G)
    Bt, num_slots = (5, 9) if not CUDA else (70, 90)
    inp = to_dev(make_ssm_inputs(g, Bt, H, P, G, N))
    pool = torch.randn(num_slots, H, P, N, generator=g).to(DEV)
    slots = torch.randperm(num_slots, generator=g)[:Bt].tolist()
    before, pool_ref = pool.clone(), pool.clone()
    y = call(selective_state_update_triton, inp, pool, slots, limit=limit)
    y_ref = call(selective_state_update_ref, inp, pool_ref, slots, limit=limit)
    assert y.dtype == inp.x.dtype and y.shape == (Bt, H, P)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert_pool_close(pool, pool_ref)  # unused slots untouched too
    # and the float64 recurrence, as an independent oracle
    cpu = SSMInputs(**{k: v.cpu() for k, v in vars(inp).items()})
    y64, states = naive_ssm(cpu, list(range(Bt + 1)), before.cpu()[slots], limit=limit)
    torch.testing.assert_close(y.cpu().double(), y64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool.cpu()[slots].double(), states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_bf16_activations(state_dtype: torch.dtype) -> None:
    g = gen(10)
    Bt = 3
    inp = to_dev(make_ssm_inputs(g, Bt, H, P, 2, N, torch.bfloat16))
    pool = torch.randn(5, H, P, N, generator=g).to(state_dtype).to(DEV)
    pool_ref = pool.clone()
    y = call(selective_state_update_triton, inp, pool, [3, 0, 2])
    y_ref = call(selective_state_update_ref, inp, pool_ref, [3, 0, 2])
    assert y.dtype == torch.bfloat16 and pool.dtype == state_dtype
    # y is rounded once to bf16 from fp32 values that agree to ~1e-6
    torch.testing.assert_close(y, y_ref, rtol=2.0**-7, atol=1e-2)
    assert_pool_close(pool, pool_ref)


@pytest.mark.parametrize("use_D,use_bias,softplus",
                         [(False, False, False), (True, False, True), (False, True, False)])
def test_optional_parts(use_D: bool, use_bias: bool, softplus: bool) -> None:
    g = gen(20)
    inp = to_dev(make_ssm_inputs(g, 2, H, P, 1, N))
    inp.dt = inp.dt.abs() + 0.05  # positive step sizes when softplus is off
    pool = torch.randn(3, H, P, N, generator=g).to(DEV)
    pool_ref = pool.clone()
    kw = dict(use_D=use_D, use_bias=use_bias, softplus=softplus)
    y = call(selective_state_update_triton, inp, pool, [2, 0], **kw)
    y_ref = call(selective_state_update_ref, inp, pool_ref, [2, 0], **kw)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert_pool_close(pool, pool_ref)


def test_softplus_tails() -> None:
    """Very negative dt (softplus ~ exp(dt), where log(1 + u) alone loses digits) and dt > 20."""
    g = gen(30)
    inp = to_dev(make_ssm_inputs(g, 2, H, P, 1, N))
    inp.dt = torch.tensor([[-30.0, -12.0, 25.0, 0.3] * (H // 4)] * 2).to(DEV)
    inp.dt_bias = torch.zeros_like(inp.dt_bias)
    inp.A = inp.A / 30.0  # keep exp(dt A) away from zero at dt = 25
    pool = torch.randn(2, H, P, N, generator=g).to(DEV)
    pool_ref = pool.clone()
    y = call(selective_state_update_triton, inp, pool, [1, 0])
    y_ref = call(selective_state_update_ref, inp, pool_ref, [1, 0])
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert_pool_close(pool, pool_ref)


def test_strided_views_and_padding_slot() -> None:
    """x, B, C as views into one projection (the mixer's layout); a negative slot is skipped."""
    g = gen(40)
    Bt, G = 3, 2
    proj = torch.randn(Bt, H * P + 2 * G * N + 5, generator=g).to(DEV)
    x = proj[:, :H * P].view(Bt, H, P)
    B = proj[:, H * P:H * P + G * N].view(Bt, G, N)
    C = proj[:, H * P + G * N:H * P + 2 * G * N].view(Bt, G, N)
    base = to_dev(make_ssm_inputs(g, Bt, H, P, G, N))
    inp = SSMInputs(x=x, dt=base.dt, A=base.A, B=B, C=C, D=base.D, dt_bias=base.dt_bias)
    pool = torch.randn(4, H, P, N, generator=g).to(DEV)
    before = pool.clone()
    y = call(selective_state_update_triton, inp, pool, [3, -1, 1])
    keep = [0, 2]
    sub = SSMInputs(x=x[keep], dt=base.dt[keep], A=base.A, B=B[keep], C=C[keep], D=base.D,
                    dt_bias=base.dt_bias)
    pool_ref = before.clone()
    y_ref = call(selective_state_update_ref, sub, pool_ref, [3, 1])
    torch.testing.assert_close(y[keep], y_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    assert_pool_close(pool, pool_ref)


@pytest.mark.parametrize("cfg", [SSUConfig(1, 1), SSUConfig(4, 2, slot_major=False, evict_first=True)])
def test_every_tile_shape_gives_the_same(cfg: SSUConfig) -> None:
    g = gen(50)
    inp = to_dev(make_ssm_inputs(g, 2, H, P, 2, N))
    pool = torch.randn(3, H, P, N, generator=g).to(DEV)
    pool_ref = pool.clone()
    y = launch_ssu(pool, inp.x, inp.dt, inp.A, inp.B, inp.C, i32([0, 2]).to(DEV), inp.D, inp.dt_bias, True,
                   INF_LIMIT, cfg)
    y_ref = call(selective_state_update_ref, inp, pool_ref, [0, 2])
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert_pool_close(pool, pool_ref)


def test_rejects_bad_arguments_like_the_ref() -> None:
    g = gen(60)
    inp = make_ssm_inputs(g, 2, H, P, 1, N)
    pool = torch.randn(3, H, P, N + 1, generator=g)
    with pytest.raises(ValueError, match="ssm_state must have shape"):
        call(selective_state_update_triton, inp, pool, [0, 1])
    with pytest.raises(ValueError, match="A must be one of"):
        selective_state_update_triton(pool[..., :N].contiguous(), inp.x, inp.dt, inp.A.double(), inp.B, inp.C,
                                      state_indices=i32([0, 1]))
