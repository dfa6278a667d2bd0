"""Triton feed-forward activation (act(x), act(gate) * up) against the pure-torch reference, which is
the HF modules' own sequence of ops.

On CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET), on tiny
shapes whose widths leave a partial column block; with CUDA the same checks run at Bamba-9B's and
Nemotron-H-8B's widths.
"""

from __future__ import annotations

import pytest
import torch
from kernel_oracles import gen
from torch import Tensor

from pd_ssm.kernels.mlp_act import mlp_act_ref
from pd_ssm.kernels.mlp_act_triton import BLOCK, mlp_act_triton

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
T, WIDTH = (37, 14336) if CUDA else (5, BLOCK + 40)
EXACT = ("relu", "relu2")  # no transcendental: the same fp32 values before the one rounding


def assert_act_close(out: Tensor, ref: Tensor, act: str) -> None:
    """fp32: a few ulp (Triton's exp / erf). bf16 / fp16: the fp32 values agree to ~1e-6, so the
    rounded ones differ by one ulp at a rounding boundary, twice with the gate's product. (Triton 3.6's
    interpreter truncates fp32 -> bf16 instead of rounding to nearest, so on CPU bf16 is checked only
    to that tolerance; on the GPU the exact activations must match bit for bit.)"""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    # NOTE: gelu's 1 + erf(x / sqrt 2) cancels for x << 0: an erf one ulp apart is ~1e-4 relative there
    tiny = 1e-5 if act == "gelu" else 1e-6
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=tiny)
        return
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[out.dtype]
    torch.testing.assert_close(out, ref, rtol=2 * ulp, atol=tiny)
    if CUDA or out.dtype != torch.bfloat16:
        if act in EXACT:
            assert torch.equal(out, ref)
        else:
            assert (out != ref).float().mean().item() < (0.05 if act == "gelu" else 0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["silu", "relu", "relu2", "gelu"])
@pytest.mark.parametrize("gated", [True, False])
def test_matches_ref(dtype: torch.dtype, act: str, gated: bool) -> None:
    g = gen(3)
    x = (3 * torch.randn(T, (2 if gated else 1) * WIDTH, generator=g)).to(dtype).to(DEV)
    out = mlp_act_triton(x, act, gated=gated)
    assert out.shape == (T, WIDTH)
    assert_act_close(out, mlp_act_ref(x, act, gated=gated), act)


def test_reference_is_the_separate_ops() -> None:
    g = gen(4)
    x = torch.randn(6, 2 * 24, generator=g).to(torch.bfloat16)
    gate, up = x[:, :24], x[:, 24:]
    assert torch.equal(mlp_act_ref(x, "silu", gated=True), torch.nn.functional.silu(gate) * up)
    assert torch.equal(mlp_act_ref(x, "relu2", gated=False), torch.square(torch.relu(x)))


@pytest.mark.parametrize("gated", [True, False])
def test_row_stride_and_empty(gated: bool) -> None:
    """x a view of wider rows (e.g. a slice of a bigger projection); no rows at all."""
    g = gen(5)
    width = 40
    full = torch.randn(4, (2 if gated else 1) * width + 24, generator=g).to(DEV)
    x = full[:, 8:8 + (2 if gated else 1) * width]
    assert x.stride(0) != x.shape[1]
    assert_act_close(mlp_act_triton(x, "silu", gated=gated), mlp_act_ref(x, "silu", gated=gated), "silu")
    assert mlp_act_triton(x[:0], "silu", gated=gated).shape == (0, width)


@pytest.mark.parametrize("fn", [mlp_act_ref, mlp_act_triton])
def test_bad_arguments_are_errors(fn: object) -> None:
    x = torch.randn(3, 7, device=DEV)
    with pytest.raises(ValueError, match="even width"):
        fn(x, "silu", gated=True)  # type: ignore[operator]
    with pytest.raises(ValueError, match="unsupported activation 'tanh'"):
        fn(x, "tanh", gated=False)  # type: ignore[operator]
    with pytest.raises(ValueError, match="stride 1"):
        fn(torch.randn(8, 3, device=DEV).t(), "relu", gated=False)  # type: ignore[operator]
