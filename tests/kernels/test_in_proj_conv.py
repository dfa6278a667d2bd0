"""in_proj with the conv update folded in (kernels/in_proj_conv_triton.py), one decode row.

Checks: the one-launch kernel against the two launches it replaces (the GEMV kernel, then the conv
update kernel) to the bit -- in_proj's output, the conv's output and the conv state; against
`in_proj_conv_ref`; the padding rule (a negative slot touches no state and gives zeros); and the
decode step fed its conv output (`mamba2_decode_step(..., xbc=...)`) against the step that runs
the conv itself. On CPU through Triton's interpreter on tiny shapes; on CUDA also at the
Mamba2-2.7B shape.
"""

from __future__ import annotations

import pytest
import torch
from kernel_oracles import compiled_ptx, gen
from torch import Tensor

from pd_ssm.kernels.conv1d_triton import causal_conv1d_update_triton
from pd_ssm.kernels.in_proj_conv_triton import _in_proj_conv_kernel, in_proj_conv_triton
from pd_ssm.kernels.l2_prefetch import L2Rows
from pd_ssm.kernels.mixer_decode import in_proj_conv_ref, mamba2_decode_step_ref
from pd_ssm.kernels.mixer_decode_triton import mamba2_decode_step_triton
from pd_ssm.kernels.skinny_linear_triton import FMA_TILE, LinearTile, skinny_linear_triton

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
WIDTH = 4
# (hidden K, d_inner, H, N, G): xBC starts inside a 32-column tile (d_inner 40) and on one (64);
# in_proj N = d_inner + conv_dim + H is narrow (<= 4096: the 4-row GEMV tile) or wide (2.7B)
SHAPES = [(48, 40, 4, 8, 1), (64, 64, 4, 16, 2)] + ([(2560, 5120, 80, 128, 1)] if CUDA else [])


def case(K: int, d_inner: int, H: int, N: int, G: int, dtype: torch.dtype, seed: int) -> dict[str, Tensor]:
    g = gen(seed)
    conv_dim = d_inner + 2 * G * N

    def r(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(DEV)

    n = d_inner + conv_dim + H
    return {
        "hidden": r(1, K).to(dtype),
        "weight": r(n, K, scale=K ** -0.5).to(dtype),
        "bias": r(n, scale=0.1).to(dtype),
        "conv_state": r(5, conv_dim, WIDTH - 1).to(dtype),
        "conv_weight": r(conv_dim, WIDTH, scale=0.5).to(dtype),
        "conv_bias": r(conv_dim, scale=0.1).to(dtype),
        "slot": torch.tensor([int(torch.randint(0, 5, (1,), generator=g))], dtype=torch.int32, device=DEV),
    }


def two_launches(c: dict[str, Tensor], d_inner: int, bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    state = c["conv_state"].clone()
    proj = skinny_linear_triton(c["hidden"], c["weight"], c["bias"] if bias else None)
    conv_dim = c["conv_weight"].shape[0]
    xbc = causal_conv1d_update_triton(proj[:, d_inner:d_inner + conv_dim], state, c["conv_weight"], c["conv_bias"],
                                      state_indices=c["slot"])
    return proj, xbc, state


def fused(c: dict[str, Tensor], d_inner: int, bias: bool, slot: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    state = c["conv_state"].clone()
    proj, xbc = in_proj_conv_triton(c["hidden"], c["weight"], c["bias"] if bias else None, state, c["conv_weight"],
                                    c["conv_bias"], state_indices=c["slot"] if slot is None else slot,
                                    conv_start=d_inner, fused=True)
    return proj, xbc, state


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_one_launch_equals_the_two_it_replaces(shape: tuple[int, ...], dtype: torch.dtype, bias: bool) -> None:
    K, d_inner, H, N, G = shape
    c = case(K, d_inner, H, N, G, dtype, seed=K + d_inner + int(bias))
    want = two_launches(c, d_inner, bias)
    got = fused(c, d_inner, bias)
    for name, a, b in zip(("proj", "xbc", "conv state"), got, want, strict=True):
        assert torch.equal(a, b), f"{name} differs from the two-launch path"
    # and against the reference (torch's linear sums in another order: close, not equal)
    state = c["conv_state"].clone()
    proj, xbc = in_proj_conv_ref(c["hidden"], c["weight"], c["bias"] if bias else None, state, c["conv_weight"],
                                 c["conv_bias"], state_indices=c["slot"], conv_start=d_inner)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], proj, **tol)
    torch.testing.assert_close(got[1], xbc, **tol)
    torch.testing.assert_close(got[2], state, **tol)
    untouched = [s for s in range(5) if s != int(c["slot"])]
    assert torch.equal(got[2][untouched], c["conv_state"][untouched])


@pytest.mark.parametrize("shape", SHAPES)
def test_fewer_columns_a_program_are_the_same_sums(shape: tuple[int, ...]) -> None:
    """LinearTile.cols: a program owning fewer columns than its tile (the grid balanced over the SMs)
    sums each column as before, the conv's channels split anywhere across programs."""
    K, d_inner, H, N, G = shape
    c = case(K, d_inner, H, N, G, torch.bfloat16, seed=5)
    base, fewer = LinearTile(8, 256, 4, 3), LinearTile(8, 256, 4, 3, cols=5)
    if K > 256:  # the 2.7B shape: the engine's tile, and 27 of its 32 columns (392 programs, 3 a SM)
        base, fewer = FMA_TILE, FMA_TILE._replace(cols=27)
    want, got = [], []
    for tile, out in ((base, want), (fewer, got)):
        state = c["conv_state"].clone()
        out.extend(in_proj_conv_triton(c["hidden"], c["weight"], c["bias"], state, c["conv_weight"], c["conv_bias"],
                                       state_indices=c["slot"], conv_start=d_inner, fused=True, tile=tile) + (state,))
    for name, a, b in zip(("proj", "xbc", "conv state"), got, want, strict=True):
        assert torch.equal(a, b), f"{name} differs with fewer columns a program"
    with pytest.raises(ValueError, match="cols"):
        in_proj_conv_triton(c["hidden"], c["weight"], c["bias"], c["conv_state"].clone(), c["conv_weight"],
                            c["conv_bias"], state_indices=c["slot"], conv_start=d_inner, fused=True,
                            tile=LinearTile(8, 256, 4, 3, cols=9))


@pytest.mark.parametrize("shape", SHAPES)
def test_asking_l2_for_out_proj_changes_nothing(shape: tuple[int, ...]) -> None:
    """An L2Rows hint (out_proj's weight, the layer's next stream) moves bytes earlier, no value: the
    same bits with and without it; on the GPU the one-row kernel is compiled with the prefetch."""
    K, d_inner, H, N, G = shape
    c = case(K, d_inner, H, N, G, torch.bfloat16, seed=K + 11)
    w_out = (torch.randn(K, d_inner, generator=gen(K)) * d_inner ** -0.5).to(DEV, torch.bfloat16)  # [hidden, d_inner]
    want = fused(c, d_inner, True)
    for head in (128, 1024, 1 << 16):  # 1 << 16: longer than a row, cut at its end
        state = c["conv_state"].clone()
        got = in_proj_conv_triton(c["hidden"], c["weight"], c["bias"], state, c["conv_weight"], c["conv_bias"],
                                  state_indices=c["slot"], conv_start=d_inner, fused=True,
                                  prefetch=L2Rows(w_out, head)) + (state,)
        for name, a, b in zip(("proj", "xbc", "conv state"), got, want, strict=True):
            assert torch.equal(a, b), f"{name} differs with the hint"
    if CUDA:
        assert any("prefetch.global.L2" in ptx for ptx in compiled_ptx(_in_proj_conv_kernel))
    with pytest.raises(ValueError, match="stride 1"):
        in_proj_conv_ref(c["hidden"], c["weight"], c["bias"], c["conv_state"].clone(), c["conv_weight"],
                         c["conv_bias"], state_indices=c["slot"], conv_start=d_inner, prefetch=L2Rows(w_out.t(), 128))


def test_padding_slot_touches_no_state() -> None:
    K, d_inner, H, N, G = SHAPES[0]
    c = case(K, d_inner, H, N, G, torch.bfloat16, seed=3)
    proj, xbc, state = fused(c, d_inner, True, slot=torch.tensor([-1], dtype=torch.int32, device=DEV))
    assert torch.equal(state, c["conv_state"])
    assert not xbc.any()
    assert torch.equal(proj, skinny_linear_triton(c["hidden"], c["weight"], c["bias"]))


def test_decode_step_fed_the_conv_output() -> None:
    K, d_inner, H, N, G = SHAPES[1]
    c = case(K, d_inner, H, N, G, torch.float32, seed=9)
    g = gen(10)
    P = d_inner // H
    ssm = (torch.randn(5, H, P, N, generator=g)).to(DEV)
    A = -torch.rand(H, generator=g).to(DEV) - 0.5
    D, dt_bias = torch.randn(H, generator=g).to(DEV), (torch.randn(H, generator=g) * 0.5).to(DEV)
    norm_w = (1 + 0.1 * torch.randn(d_inner, generator=g)).to(DEV)
    # the step that runs the conv itself, on in_proj's output
    conv_a, ssm_a = c["conv_state"].clone(), ssm.clone()
    proj = skinny_linear_triton(c["hidden"], c["weight"], c["bias"])
    want = mamba2_decode_step_triton(proj, conv_a, c["conv_weight"], c["conv_bias"], ssm_a, A, D, dt_bias, norm_w,
                                     state_indices=c["slot"], ngroups=G)
    # the fused in_proj + conv, then the step fed its output
    conv_b, ssm_b = c["conv_state"].clone(), ssm.clone()
    proj_b, xbc = in_proj_conv_triton(c["hidden"], c["weight"], c["bias"], conv_b, c["conv_weight"], c["conv_bias"],
                                      state_indices=c["slot"], conv_start=d_inner, fused=True)
    got = mamba2_decode_step_triton(proj_b, conv_b, c["conv_weight"], c["conv_bias"], ssm_b, A, D, dt_bias, norm_w,
                                    state_indices=c["slot"], ngroups=G, xbc=xbc)
    assert torch.equal(got.g, want.g) and torch.equal(got.sq, want.sq)
    assert torch.equal(conv_b, conv_a) and torch.equal(ssm_b, ssm_a)
    # the reference, given the conv output, skips its own conv
    conv_r, ssm_r = c["conv_state"].clone(), ssm.clone()
    proj_r, xbc_r = in_proj_conv_ref(c["hidden"], c["weight"], c["bias"], conv_r, c["conv_weight"], c["conv_bias"],
                                     state_indices=c["slot"], conv_start=d_inner)
    ref = mamba2_decode_step_ref(proj_r, conv_r, c["conv_weight"], c["conv_bias"], ssm_r, A, D, dt_bias, norm_w,
                                 state_indices=c["slot"], ngroups=G, xbc=xbc_r)
    torch.testing.assert_close(ref.g, got.g, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv_r, conv_b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ssm_r, ssm_b, rtol=1e-4, atol=1e-4)


def test_bad_columns_refused() -> None:
    K, d_inner, H, N, G = SHAPES[0]
    c = case(K, d_inner, H, N, G, torch.float32, seed=1)
    with pytest.raises(ValueError, match="do not fit"):
        in_proj_conv_triton(c["hidden"], c["weight"], None, c["conv_state"], c["conv_weight"], None,
                            state_indices=c["slot"], conv_start=c["weight"].shape[0], fused=True)
